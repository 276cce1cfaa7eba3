"""Does the README's quickstart visibly learn, and how long does a newcomer wait: `python -m
bench.quickstart`.

Runs `lorarl prepare quickstart`, then `lorarl run examples/quickstart.yaml --local` as the README
has it (the CLI in a subprocess, from the repository root, the engine interpreter found by the CLI
itself) once per seed (`training.seed`: LoRA init and sampling). Per run: the reward's first-5 vs
last-5 step mean, the KL to the starting model, the wall seconds of the `lorarl run` process
(engine start-up included) and whether torch Inductor's kernel cache was warm (a cold one adds
~20 s to the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "quickstart.json"
MANIFEST = ROOT / "examples" / "quickstart.yaml"
SEEDS = (42, 43, 44)


def lorarl(*args: str) -> list[str]:
    """The `lorarl` console script next to this interpreter (what the activated venv runs)."""
    return [str(Path(sys.executable).with_name("lorarl")), *args]


def inductor_cache_warm() -> bool:
    from lorarl.engines.vllm import inductor_cache_dir

    cache = Path(inductor_cache_dir(os.environ, str(Path.home())))
    return cache.is_dir() and any(cache.iterdir())


def mean(values: list[float]) -> float:
    return round(statistics.mean(values), 4)


def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    rewards = [h["rewardMean"] for h in history]
    kls = [h.get("kl") or 0.0 for h in history]
    return {
        "steps": len(history),
        "reward_first5": mean(rewards[:5]),
        "reward_last5": mean(rewards[-5:]),
        "reward_gain": round(statistics.mean(rewards[-5:]) - statistics.mean(rewards[:5]), 4),
        "kl_last5": mean(kls[-5:]),
        "kl_max": round(max(kls), 4),
        "train_s": round(sum(h["stepSeconds"] for h in history), 1),
        "first_step_s": round(history[0]["stepSeconds"], 1),
        "median_step_s": round(statistics.median(h["stepSeconds"] for h in history), 2),
        "rewards": [round(r, 4) for r in rewards],
        "kl": [round(k, 4) for k in kls],
    }


def run_seed(seed: int, workdir: Path, timeout_s: float) -> dict[str, Any]:
    manifest = yaml.safe_load(MANIFEST.read_text())
    manifest["spec"]["training"]["seed"] = seed
    job = workdir / f"quickstart-{seed}.yaml"
    job.write_text(yaml.safe_dump(manifest, sort_keys=False))
    run_dir = workdir / f"run-{seed}"
    warm = inductor_cache_warm()
    load = os.getloadavg()[0]
    start = time.monotonic()
    cmd = lorarl("run", str(job), "--local", "--run-dir", str(run_dir), "--status-port", "-1")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: lorarl run failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")  # fmt: skip
    lines = (run_dir / "history.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines if line.strip()]
    return {
        "seed": seed,
        "wall_s": round(wall, 1),
        **summarize(history),
        "inductor_cache_warm": warm,
        "load_avg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    info = machine()
    from lorarl.local.models import PREPARED_MARKER, TINY_NAME

    cached = (ROOT / ".cache" / "lorarl" / "models" / TINY_NAME / PREPARED_MARKER).is_file()
    start = time.monotonic()
    subprocess.run(lorarl("prepare", "quickstart"), cwd=ROOT, check=True, capture_output=True)
    prepare_s = time.monotonic() - start
    with tempfile.TemporaryDirectory(prefix="lorarl-quickstart-") as tmp:
        runs = []
        for seed in args.seeds:
            runs.append(run_seed(seed, Path(tmp), args.timeout))
            print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("rewards", "kl")}))
    info["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    report = {
        "machine": info,
        "command": "lorarl prepare quickstart && lorarl run examples/quickstart.yaml --local",
        "prepare_s": round(prepare_s, 1),
        "prepare_model_cached": cached,  # a cached model skips the few seconds of teaching
        "seeds": len(runs),
        "reward_first5_mean": mean([r["reward_first5"] for r in runs]),
        "reward_last5_mean": mean([r["reward_last5"] for r in runs]),
        "rose_in_every_run": all(r["reward_last5"] > r["reward_first5"] + 0.2 for r in runs),
        "kl_last5_mean": mean([r["kl_last5"] for r in runs]),
        "wall_s_median": round(statistics.median(r["wall_s"] for r in runs), 1),
        "wall_s_max": max(r["wall_s"] for r in runs),
        "runs": runs,
    }
    write_results(args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "machine")}, indent=2))


if __name__ == "__main__":
    main()
