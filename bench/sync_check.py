"""What the stale-policy guard (`rollout.syncCheck`) costs per step: `python -m bench.sync_check`.

`examples/demo.yaml` (SmolLM2-135M-Instruct, GRPO + LoRA r=16, one colocated vLLM CPU engine)
under `lorarl run --local`, shortened to `--steps`, in merged and adapter mode, each with the
guard on and off, alternating (on/off, then off/on on the next repetition). Per run, from the
run's history.jsonl over steps 2.. (step 1 carries start-up):
- `check_s`: the guard's own seconds per step, as the trainer measures them (`syncCheckSeconds`:
  the probe forward after the update plus the probe request to the engine);
- `step_s`: median step seconds (on vs off: the same cost seen in the step, within noise);
- `gap`: the largest passing probe gap (`syncCheckGap`) against the tolerance of the model's dtype.
Settings: the demo's, with `model.dtype` float32 (the faster dtype on this CPU, as `lorarl run`
says) unless `--dtype`. Writes bench/results/sync_check.json.
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

from bench.common import ROOT, machine, write_results
from lorarl.trainer.fleet.sync_check import DEFAULT_TOLERANCE

RESULTS = ROOT / "bench" / "results" / "sync_check.json"
DEMO = ROOT / "examples" / "demo.yaml"


def run_once(tmp: Path, mode: str, guard: bool, steps: int, dtype: str) -> dict[str, Any]:
    doc = yaml.safe_load(DEMO.read_text())
    spec = doc["spec"]
    spec["model"]["dtype"] = dtype
    spec["rollout"]["syncMode"] = mode
    spec["rollout"]["syncCheck"] = {"enabled": guard}
    spec["training"]["totalSteps"] = steps
    name = f"{mode}-{'on' if guard else 'off'}-{int(time.time() * 1000) % 100000}"
    job_file, run_dir = tmp / f"{name}.yaml", tmp / name
    job_file.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "LORARL_ENGINE_PYTHON": os.environ.get(
        "LORARL_ENGINE_PYTHON", str(ROOT / ".venv-engine" / "bin" / "python"))}  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "lorarl.cli.main", "run", str(job_file), "--local",
         "--run-dir", str(run_dir), "--status-port", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    history = [
        json.loads(line)
        for line in (run_dir / "history.jsonl").read_text().splitlines()
        if line.strip()
    ][1:]
    checks = [r["syncCheckSeconds"] for r in history if r.get("syncCheckSeconds") is not None]
    gaps = [r["syncCheckGap"] for r in history if r.get("syncCheckGap") is not None]
    return {
        "mode": mode,
        "guard": guard,
        "wall_s": round(time.monotonic() - start, 1),
        "step_s": round(statistics.median(r["stepSeconds"] for r in history), 3),
        "check_s": round(statistics.median(checks), 4) if checks else None,
        "check_fraction": (
            round(
                statistics.median(checks) / statistics.median(r["stepSeconds"] for r in history), 4
            )
            if checks
            else None
        ),
        "gap_max": max(gaps) if gaps else None,
        "steps_measured": len(history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=sorted(DEFAULT_TOLERANCE))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cli = [sys.executable, "-m", "lorarl.cli.main", "prepare"]  # what `make demo` prepares
    subprocess.run([*cli, "smollm2"], cwd=ROOT, check=True)
    subprocess.run([*cli, "task", "larger", "-n", "512", "-o", ".cache/lorarl/data/larger.jsonl"],
                   cwd=ROOT, check=True)  # fmt: skip
    runs = []
    with tempfile.TemporaryDirectory(prefix="lorarl-sync-check-") as tmp:
        for rep in range(args.reps):
            for mode in ("merged", "adapter"):
                order = (True, False) if rep % 2 == 0 else (False, True)
                for guard in order:
                    record = run_once(Path(tmp), mode, guard, args.steps, args.dtype)
                    print(json.dumps(record), flush=True)
                    runs.append(record)
    summary = {}
    for mode in ("merged", "adapter"):
        on = [r for r in runs if r["mode"] == mode and r["guard"]]
        off = [r for r in runs if r["mode"] == mode and not r["guard"]]
        summary[mode] = {
            "check_s_per_step": statistics.median(r["check_s"] for r in on),
            "check_fraction_of_step": statistics.median(r["check_fraction"] for r in on),
            "step_s_guard_on": statistics.median(r["step_s"] for r in on),
            "step_s_guard_off": statistics.median(r["step_s"] for r in off),
            "gap_max": max(r["gap_max"] for r in on),
            "tolerance": DEFAULT_TOLERANCE[args.dtype],
        }
    write_results(
        args.out,
        {
            "benchmark": "sync_check",
            "method": __doc__,
            "machine": machine(),
            "settings": {
                "job": "examples/demo.yaml",
                "model": "SmolLM2-135M-Instruct",
                "dtype": args.dtype,
                "steps": args.steps,
                "reps": args.reps,
                "engine": "vllm (CPU), colocated, 1 replica",
                "probe_tokens": 64,
            },
            "summary": summary,
            "runs": runs,
        },
    )
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
