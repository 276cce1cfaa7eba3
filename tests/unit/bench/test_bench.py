"""The benchmark harness's own logic: the rendered table, the A/B order, the step breakdown."""

from __future__ import annotations

import json

import pytest
from bench import render, run_all
from bench.common import write_results
from bench.vs_trl import RunStats, breakdown, notes, rep_speedups, side_order


def test_committed_table_is_rendered_from_the_committed_results():
    """bench/results/README.md must be what `python -m bench.render` makes of the JSON files."""
    committed = (render.RESULTS / "README.md").read_text()
    assert committed == render.render(render.RESULTS), "run `python -m bench.render`"


def test_vs_trl_table_names_both_raw_figures_the_ratio_and_the_breakdown():
    doc = json.loads((render.RESULTS / "vs_trl.json").read_text())
    page = render.render_vs_trl(doc)
    for r in doc["records"]:
        row = next(line for line in page.splitlines() if line.startswith(f"| {r['model']} | "))
        assert render.fmt(r["lorarl_step_s"]) in row and render.fmt(r["trl_step_s"]) in row
        assert f"×{render.fmt(r['step_speedup'])}" in row
    assert "Where a step's time goes:" in page
    assert sum(1 for line in page.splitlines() if "| lorarl |" in line) == len(doc["records"])


def test_an_unreadable_results_file_is_reported_not_skipped(tmp_path):
    (tmp_path / "sync.json").write_text("{not json")
    (tmp_path / "demo.json").write_text(json.dumps({"seconds": 1.5, "machine": {"cpu_count": 2}}))
    page = render.render(tmp_path)
    assert "## sync\n\n_unreadable:" in page
    assert "| seconds | 1.5 |" in page
    assert page.index("## demo") < page.index("## sync")  # the known order, not alphabetical


def test_results_are_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "x.json"
    write_results(path, {"a": 1})

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("bench.common.os.replace", fail)
    with pytest.raises(OSError):
        write_results(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}


def test_pairs_alternate_which_side_runs_first():
    assert [side_order(rep) for rep in range(4)] == [
        ("lorarl", "trl"), ("trl", "lorarl"), ("lorarl", "trl"), ("trl", "lorarl"),
    ]  # fmt: skip


def _run(side: str, steps: list[float], **parts: list[float]) -> RunStats:
    run = RunStats(side, 0, step_s=steps, load_avg_1m=[1.0, 2.0])
    for name, values in parts.items():
        setattr(run, f"{name}_s", values)
    return run


def test_breakdown_leaves_out_the_warm_up_step_and_shares_sum_to_one():
    run = _run("lorarl", [100.0, 10.0, 10.0], generate=[90.0, 2.0, 3.0], update=[5.0, 6.0, 6.0],
               reward=[0.0, 0.5, 0.5], sync=[1.0, 1.0, 0.0])  # fmt: skip
    shares = breakdown([run])
    assert shares == {"generate": 0.25, "reward": 0.05, "update": 0.6, "sync": 0.05, "other": 0.05}


def test_per_pair_speedup_is_trl_over_lorarl_median_after_warm_up():
    lorarl = [_run("lorarl", [9.0, 2.0, 2.0, 3.0])]
    trl = [_run("trl", [1.0, 4.0, 5.0, 6.0])]
    assert rep_speedups(lorarl, trl) == [2.5]


def test_notes_report_each_sides_load_range():
    record = {"model": "m", "step_speedup_per_rep": [1.1], "seeds": [42],
              "runs": [{"side": "lorarl", "load_avg_1m": [1.0, 3.0]},
                       {"side": "trl", "load_avg_1m": [2.0, 2.5]}]}  # fmt: skip
    first = notes([record])[0]
    assert "lorarl 1.0-3.0, trl 2.0-2.5" in first and "[1.1]" in first and "[42]" in first


def test_run_all_rejects_an_unknown_benchmark_name():
    assert run_all.selected(["sync"], []) == ["sync"]
    assert "vs_trl" not in run_all.selected(None, ["vs_trl"])
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all.selected(["speed"], [])


def test_vs_trl_table_shows_the_overlapped_runs_apart_from_the_headline_ratio():
    doc = json.loads((render.RESULTS / "vs_trl.json").read_text())
    record = doc["records"][0]
    record |= {
        "lorarl_async_step_s": 9.5,
        "lorarl_async_final_reward": 0.4,
        "async_speedup_vs_trl": 1.83,
        "async_speedup_vs_lorarl": 1.63,
        "lorarl_async": {"first_reward": 0.2, "breakdown": {"generate": 0.4, "update": 0.9}},
    }
    page = render.render_vs_trl(doc)
    row = next(line for line in page.splitlines() if line.startswith(f"| {record['model']} | 9.5"))
    assert "×1.83" in row and "×1.63" in row and "0.2 → 0.4" in row and "40 / 90 / 0" in row
    assert page.index("Where a step's time goes:") < page.index("offPolicySteps: 1")


def test_the_defaults_row_leaves_both_libraries_at_their_defaults(tmp_path):
    """The headline compares each side as installed: no pinned threads, lorarl's own dtype,
    no GRPOConfig field beyond the shared workload."""
    from bench.vs_trl import VARIANTS, WORKLOADS, lorarl_job, thread_env

    from lorarl.api.spec.job import ModelSpec

    defaults = VARIANTS["defaults"]
    assert thread_env(defaults.threads) == {} and defaults.trl_config == {}
    job = lorarl_job(WORKLOADS["smollm2"], tmp_path, tmp_path / "d.jsonl", "x")
    assert job.spec.model.dtype == ModelSpec.model_fields["dtype"].default
    pinned = VARIANTS["pinned"]
    assert thread_env(pinned.threads) == {"OMP_NUM_THREADS": "1"}
    assert (
        lorarl_job(
            WORKLOADS["smollm2"], tmp_path, tmp_path / "d.jsonl", "x", "float32"
        ).spec.model.dtype
        == "float32"
    )


def test_rewards_per_seed_are_first_and_last_five_step_means():
    from bench.vs_trl import reward_by_seed

    run = _run("lorarl", [1.0] * 12)
    run.reward_mean = [0.0] * 5 + [0.5] * 2 + [1.0] * 5
    assert reward_by_seed([run]) == [{"rep": 0, "first": 0.0, "last": 1.0}]
