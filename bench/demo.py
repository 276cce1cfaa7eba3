"""How long `make demo` takes and whether the reward clearly rises: `python -m bench.demo`.

By default it times `make demo` in this checkout (venvs already built count as warm); `--fresh`
clones the repository into a temporary directory first, so the installs are timed too — the
"fresh machine" figure (the pip cache on this machine still helps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "demo.json"


def run(checkout: Path) -> dict:
    start = time.monotonic()
    proc = subprocess.run(["make", "demo"], cwd=checkout, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"make demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")  # fmt: skip
    lines = (checkout / "runs" / "demo" / "history.jsonl").read_text().splitlines()
    rewards = [json.loads(line)["rewardMean"] for line in lines if line.strip()]
    steps = [json.loads(line) for line in lines if line.strip()]
    return {
        "seconds": round(seconds, 1),
        "steps": len(rewards),
        "first_reward": round(rewards[0], 4),
        "final_reward": round(rewards[-1], 4),
        "first3_mean": round(statistics.mean(rewards[:3]), 4),
        "last5_mean": round(statistics.mean(rewards[-5:]), 4),
        "rewards": [round(r, 4) for r in rewards],
        "median_step_s": round(statistics.median(s["stepSeconds"] for s in steps), 2),
        "median_phase_s": {
            phase: round(statistics.median(s[f"{phase}Seconds"] for s in steps), 2)
            for phase in ("generate", "reward", "train", "sync")
            if all(s.get(f"{phase}Seconds") is not None for s in steps)
        },
        # the machine's busy share over each step (/proc/stat): do the phases leave cores idle?
        "cpu_util_mean": cpu_mean(steps),
        "adapter": str(checkout / "runs" / "demo" / "adapter"),
    }


def cpu_mean(steps: list[dict]) -> float | None:
    """Mean busy share over the steps after the first (the engines' warm-up)."""
    values = [s["cpuUtil"] for s in steps[1:] if s.get("cpuUtil") is not None]
    return round(statistics.mean(values), 3) if values else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="time it in a fresh clone")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.fresh:
        with tempfile.TemporaryDirectory(prefix="lorarl-demo-") as tmp:
            checkout = Path(tmp) / "lorarl"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True)
            result = run(checkout)
    else:
        result = run(ROOT)
    result["fresh_clone"] = args.fresh
    write_results(args.out, {"machine": machine(), **result})
    print(json.dumps({k: v for k, v in result.items() if k != "rewards"}, indent=2))


if __name__ == "__main__":
    main()
