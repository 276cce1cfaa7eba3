"""bench/results/*.json -> bench/results/README.md: one markdown table per results file.

    python -m bench.render          # renders only; never runs a benchmark

Every benchmark writes its own JSON shape; vs_trl gets a purpose-built table (the ratios and the
step-time breakdown), every other file a generic one: its scalar fields, and each list of
records flattened to dotted columns. A file that cannot be read is reported in the page, not
skipped silently.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# Known benchmarks first, in the order a reader wants them; anything else follows by name.
ORDER = (
    "vs_trl",
    "demo",
    "tools",
    "trainer_step",
    "sync",
    "reward_service",
    "operator_scale",
    "operator_steady",
)
BREAKDOWN_PARTS = ("generate", "reward", "update", "sync", "other")


def fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0:
            return "0"
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: Iterable[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalar leaves as dotted keys; lists and machine descriptions are left out."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "machine" or isinstance(value, list):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


def machine_line(m: dict[str, Any] | None) -> str:
    if not m:
        return "_machine: not recorded_"
    cpu = m.get("cpu_model") or m.get("processor") or "CPU"
    parts = [f"{cpu} × {m.get('cpu_count', '?')} cores"]
    if "load_avg_1m_at_start" in m:
        load = f"load {m['load_avg_1m_at_start']}"
        if "load_avg_1m_at_end" in m:
            load += f" → {m['load_avg_1m_at_end']}"
        parts.append(load + " (1 min avg)")
    parts += [f"torch {m['torch']}" for _ in [0] if m.get("torch")]
    parts += [f"{k} {m[k]}" for k in ("trl", "transformers", "peft") if m.get(k)]
    parts.append(m.get("date", "date unknown"))
    return "_" + ", ".join(str(p) for p in parts) + "_"


def machine_of(doc: dict[str, Any]) -> dict[str, Any] | None:
    if isinstance(doc.get("machine"), dict):
        return doc["machine"]
    for value in doc.values():  # some files keep it per record
        first = value[0] if isinstance(value, list) and value else None
        if isinstance(first, dict) and isinstance(first.get("machine"), dict):
            return first["machine"]
    return None


def render_generic(doc: dict[str, Any]) -> str:
    blocks = []
    scalars = {k: v for k, v in flatten(doc).items() if k != "benchmark"}
    if scalars:
        blocks.append(table(["field", "value"], ([k, v] for k, v in scalars.items())))
    for key, value in doc.items():
        if not (isinstance(value, list) and value and all(isinstance(v, dict) for v in value)):
            continue
        flat = [flatten(v) for v in value]
        columns = list(dict.fromkeys(k for row in flat for k in row))
        blocks.append(f"`{key}`:\n\n" + table(columns, ([r.get(c) for c in columns] for r in flat)))
    return "\n\n".join(blocks) or "_no figures in this file_"


def _pair(record: dict[str, Any], key: str) -> str:
    return f"{fmt(record['lorarl'].get(key))} / {fmt(record['trl'].get(key))}"


def _k(doc: dict[str, Any]) -> int:
    """The reward window: 5 steps since the library-defaults rework, 3 before it."""
    return 5 if any("variant" in r for r in doc.get("records", [])) else 3


def render_vs_trl(doc: dict[str, Any]) -> str:
    records = doc.get("records", [])
    if not records:
        return "_no records_"
    main = table(
        ["model", "variant", "reps × steps", "s/step lorarl", "s/step TRL", "**lorarl ÷ TRL**",
         "speedup", "per rep", "generate s (l / T)", "update s (l / T)", "cpu util (l / T)",
         "tokens/s (l / T)", f"reward first{_k(doc)}→last{_k(doc)} (l)",
         f"reward first{_k(doc)}→last{_k(doc)} (T)", "wall s (l / T)"],
        [[r["model"], r.get("variant", "pinned"), f"{r['repetitions']} × {r['workload']['steps']}",
          r["lorarl_step_s"], r["trl_step_s"],
          fmt(r.get("step_ratio", round(r["lorarl_step_s"] / r["trl_step_s"], 3))),
          f"×{fmt(r['step_speedup'])}",
          ", ".join(fmt(x) for x in r.get("step_speedup_per_rep", [])), _pair(r, "generate_s"),
          _pair(r, "update_s"), _pair(r, "cpu_util"), _pair(r, "tokens_per_s"),
          f"{fmt(r['lorarl']['first_reward'])} → {fmt(r['lorarl_final_reward'])}",
          f"{fmt(r['trl']['first_reward'])} → {fmt(r['trl_final_reward'])}",
          _pair(r, "wall_s")] for r in records],
    )  # fmt: skip
    seeds = table(
        ["model", "variant", "seed", "lorarl first → last", "TRL first → last"],
        [[r["model"], r.get("variant", "pinned"), seed,
          f"{fmt(a['first'])} → {fmt(a['last'])}", f"{fmt(b['first'])} → {fmt(b['last'])}"]
         for r in records if r["lorarl"].get("reward_by_seed")
         for seed, a, b in zip(r.get("seeds", []), r["lorarl"]["reward_by_seed"],
                               r["trl"]["reward_by_seed"], strict=True)],
    )  # fmt: skip
    shares = table(
        ["model", "variant", "side", "step s", *[f"{p} %" for p in BREAKDOWN_PARTS]],
        [[r["model"], r.get("variant", "pinned"), side, r[side]["step_s"],
          *[round(100 * r[side]["breakdown"].get(p, 0.0), 1) for p in BREAKDOWN_PARTS]]
         for r in records for side in ("lorarl", "trl")],
    )  # fmt: skip
    notes = (
        "_lorarl ÷ TRL_ = lorarl median s/step ÷ TRL's (<1: lorarl faster); speedup is its "
        "inverse; medians over every step but each run's first; _per rep_ is the speedup for "
        "each A/B pair. _variant_ defaults: each library as installed; pinned: fp32, no "
        "gradient checkpointing, OMP_NUM_THREADS=1 on both sides. Shares "
        "are of the summed post-warm-up step time. _update_ is lorarl's `trainSeconds` (logprobs "
        "with grad, backward, optimizer) and, for TRL, step time minus `_prepare_inputs` (same "
        "work plus Trainer overhead). _sync_ is lorarl's merged weight push; TRL has none. Reward: "
        "mean of the first and last steps' training reward (window in the header), averaged "
        "over repetitions; per seed below. cpu util: the machine's busy share per step."
    )
    overlapped = [r for r in records if r.get("lorarl_async_step_s")]
    async_rows = table(
        ["model", "s/step lorarl offPolicySteps=1", "vs TRL", "vs lorarl on-policy",
         "reward first→last", "breakdown gen / update / sync %"],
        [[r["model"], r["lorarl_async_step_s"], f"×{fmt(r['async_speedup_vs_trl'])}",
          f"×{fmt(r['async_speedup_vs_lorarl'])}",
          f"{fmt(r['lorarl_async']['first_reward'])} → {fmt(r['lorarl_async_final_reward'])}",
          " / ".join(fmt(round(100 * r["lorarl_async"]["breakdown"].get(p, 0.0), 1))
                     for p in ("generate", "update", "sync"))] for r in overlapped],
    )  # fmt: skip
    async_text = (
        "With `training.offPolicySteps: 1` lorarl generates the next batch during the update "
        "(samples one step stale, a different algorithm from TRL's default on-policy GRPO, so "
        "not the headline ratio). Generation overlaps the update, so the shares can sum past "
        "100%:\n\n" + async_rows
    )
    workloads = table(
        ["model", "task / reward", "prompts × samples", "completion tokens", "LoRA r / α", "lr"],
        [[r["model"], f"{r['workload']['task']} / {r['workload']['reward']}",
          f"{r['workload']['prompts_per_step']} × {r['workload']['group_size']}",
          r["workload"]["max_completion_tokens"],
          f"{r['workload']['rank']} / {fmt(float(r['workload']['alpha']))}",
          r["workload"]["lr"]] for r in records],
    )  # fmt: skip
    extra = [f"- {n}" for n in doc.get("notes", [])]
    return "\n\n".join([main, "Reward per seed:", seeds, "Where a step's time goes:", shares, notes,
                        *([async_text] if overlapped else []),
                        "Workloads (identical on both sides):", workloads,
                        *(["Notes:\n\n" + "\n".join(extra)] if extra else [])])  # fmt: skip


CHAOS_COLUMNS = (
    "fault", "runs", "job_runs", "succeeded", "steps_lost_max", "trainer_restarts",
    "checkpoints_bad", "duplicate_children", "engines_on_latest", "reward_continues",
    "seconds_to_recover_p50", "seconds_to_recover_p95", "seconds_to_next_step_p50",
    "seconds_to_next_step_p95", "passed",
)  # fmt: skip


def render_chaos(doc: dict[str, Any]) -> str:
    """One row per fault with issue #17's figures; what each fault was, and what failed."""
    faults = doc["faults"]
    rows = table(list(CHAOS_COLUMNS), ([f.get(c) for c in CHAOS_COLUMNS] for f in faults))
    what = "\n".join(f"- `{f['fault']}`: {f['what']}" for f in faults)
    problems = "\n".join(
        f"- `{f['fault']}`: {'; '.join(f['acceptance_problems'])}"
        for f in faults
        if f.get("acceptance_problems")
    )
    parts = [f"Injections per fault: {doc['injections_per_fault']}; seed {doc['seed']}, "
             f"{fmt(doc['seconds'])} s in all. {doc['job']}.", rows, what]  # fmt: skip
    if doc.get("partial"):
        parts.append(f"Partial: {doc['partial']}")
    if problems:
        parts.append("Acceptance problems:\n\n" + problems)
    return "\n\n".join([*parts, doc["notes"]])


RENDERERS = {"vs_trl": render_vs_trl, "chaos": render_chaos}


def render_file(path: Path) -> str:
    name = path.stem
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"## {name}\n\n_unreadable: {exc}_\n"
    if not isinstance(doc, dict):
        return f"## {name}\n\n_unexpected content: a JSON {type(doc).__name__}, not an object_\n"
    try:
        body = RENDERERS.get(name, render_generic)(doc)
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        body = f"_could not render ({type(exc).__name__}: {exc}); generic view:_\n\n"
        body += render_generic(doc)
    return f"## {name}\n\n{machine_line(machine_of(doc))}\n\n{body}\n"


def ordered(paths: Iterable[Path]) -> list[Path]:
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(paths, key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))


def render(results: Path = RESULTS) -> str:
    files = ordered(results.glob("*.json"))
    head = (
        "# Benchmark results\n\n"
        "Generated by `python -m bench.render` from the JSON files in this folder "
        "(`make bench` re-runs the benchmarks first). Every figure was measured on the machine "
        "named under its heading; figures from different machines or loads are not comparable.\n"
    )
    if not files:
        return head + "\n_no results files yet_\n"
    return head + "\n" + "\n".join(render_file(p) for p in files)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    out = args.results / "README.md"
    out.write_text(render(args.results))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
