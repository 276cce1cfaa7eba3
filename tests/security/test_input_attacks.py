"""Hostile manifests, each refused with a short error naming the field, never a crash or a flood.

Every attack goes through `lorarl validate` (the CLI as a user runs it) and, where it survives
the trip to JSON, through the admission webhook's own handler function; each answer must be short
(a bounded excerpt of the input, not the input) and name what is wrong.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from click.testing import CliRunner

from lorarl.api import LoRARLJob
from lorarl.api.safe_yaml import MAX_DEPTH, MAX_NODES
from lorarl.cli.main import main
from lorarl.engines.flags import managed_flags, overriding_arg
from lorarl.operator.handlers import webhook
from lorarl.plan.engines import engine_command

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
JOB: dict[str, Any] = yaml.safe_load(QUICKSTART.read_text())
MAX_OUTPUT = 1000  # bytes: what any refusal below may print, whatever the input's size


def edited(path: str, value: Any) -> dict[str, Any]:
    """The quickstart with `value` at the dotted `path` under spec."""
    doc = copy.deepcopy(JOB)
    node = doc["spec"]
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return doc


def validate_text(tmp_path: Path, text: str) -> tuple[int, str]:
    f = tmp_path / "job.yaml"
    f.write_text(text)
    r = CliRunner().invoke(main, ["validate", str(f)])
    return r.exit_code, r.output


def refused_by_cli(tmp_path: Path, text: str, *expected: str) -> str:
    code, out = validate_text(tmp_path, text)
    assert code == 1, out[:MAX_OUTPUT]
    assert len(out.encode()) < MAX_OUTPUT, f"{len(out)} bytes: {out[:300]}"
    for part in expected:
        assert part in out, out
    return out


def webhook_refusal(body: Any, monkeypatch: pytest.MonkeyPatch | None = None, **config) -> str:
    if monkeypatch is not None:
        monkeypatch.setattr(webhook, "CONFIG", dataclasses.replace(webhook.CONFIG, **config))
    with pytest.raises(kopf.AdmissionError) as exc:
        webhook.validate_lorarljob(body=body, old=None, operation="CREATE")
    message = str(exc.value)
    assert len(message.encode()) < MAX_OUTPUT, f"{len(message)} bytes: {message[:300]}"
    return message


def refused_everywhere(tmp_path: Path, doc: dict, *expected: str) -> None:
    refused_by_cli(tmp_path, yaml.safe_dump(doc), *expected)
    message = webhook_refusal(doc)
    for part in expected:
        assert part in message, message


def test_the_quickstart_passes_both_gates(tmp_path: Path) -> None:
    """The baseline every attack below edits: accepted by both, so each refusal is the attack's."""
    code, out = validate_text(tmp_path, QUICKSTART.read_text())
    assert code == 0, out
    webhook.validate_lorarljob(body=copy.deepcopy(JOB), old=None, operation="CREATE")


# --- YAML and tree shape ------------------------------------------------------------------------


def test_nested_brackets_are_a_short_error_not_a_traceback(tmp_path: Path) -> None:
    f = tmp_path / "deep.yaml"
    f.write_text(QUICKSTART.read_text() + "extra: " + "[" * 5000 + "]" * 5000 + "\n")
    start = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "lorarl.cli.main", "validate", str(f)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert time.monotonic() - start < 30
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"nesting deeper than {MAX_DEPTH} levels" in r.stderr
    assert len(r.stderr) + len(r.stdout) < MAX_OUTPUT


def test_nested_json_reaching_the_webhook_is_refused() -> None:
    deep: Any = "x"
    for _ in range(5000):
        deep = [deep]
    doc = edited("reward.params", {"deep": deep})
    assert f"nesting deeper than {MAX_DEPTH} levels" in webhook_refusal(doc)


def bomb_manifest(levels: int, target_line: str) -> str:
    """The quickstart with `target_line`'s value replaced by a billion-laughs alias: 9 **
    (levels + 1) strings from a few hundred bytes of anchors."""
    lines = ["  a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [
        f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)
    ]
    text = QUICKSTART.read_text()
    assert target_line in text
    key = target_line.split(":")[0]
    return "x-bomb:\n" + "\n".join(lines) + "\n" + text.replace(target_line, f"{key}: *a{levels}")


@pytest.mark.parametrize(
    "target",
    ["    path: .cache/lorarl/models/tiny-llama-letters", "      metadata_key: pattern"],
    ids=["model.path", "reward.params"],
)
def test_alias_bomb_is_refused_before_it_expands(tmp_path: Path, target: str) -> None:
    text = bomb_manifest(6, target)
    assert len(text) < 10_000  # a few kB that expand to 9**7, about 4.8 million strings
    start = time.monotonic()
    refused_by_cli(tmp_path, text, f"more than {MAX_NODES} values once YAML aliases are expanded")
    r = CliRunner().invoke(main, ["plan", str(tmp_path / "job.yaml")])  # ran for minutes before
    assert r.exit_code == 1 and "YAML refused: more than" in r.output and len(r.output) < 1000
    assert time.monotonic() - start < 5


def test_expanded_bomb_reaching_the_webhook_is_refused() -> None:
    """kubectl expands aliases before sending JSON: the webhook sees the shared tree."""
    node: Any = ["lol"] * 9
    for _ in range(6):
        node = [node] * 9  # shared references: cheap to build, 9**7 values to walk
    message = webhook_refusal(edited("reward.params", {"pattern": node}))
    assert f"more than {MAX_NODES} values" in message


def test_duplicate_keys_are_refused_not_last_wins(tmp_path: Path) -> None:
    text = QUICKSTART.read_text().replace("    rank: 8\n", "    rank: 8\n    rank: 1024\n", 1)
    assert text.count("rank:") == 2
    refused_by_cli(tmp_path, text, 'duplicate key "rank" at line', "once per mapping")


def test_a_huge_file_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    text = QUICKSTART.read_text() + "#" + "x" * (2 * 1024 * 1024) + "\n"
    refused_by_cli(tmp_path, text, "larger than 1048576 bytes")


def test_a_long_value_is_echoed_only_as_an_excerpt(tmp_path: Path) -> None:
    out = refused_by_cli(tmp_path, yaml.safe_dump(edited("lora.rank", "9" * 50_000 + "x")))
    assert "spec.lora.rank: must be an integer" in out and "9999..." in out


# --- numbers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
@pytest.mark.parametrize("path", ["lora.alpha", "optim.gradClip", "algorithm.kl.coef"])
def test_non_finite_numbers_are_refused(tmp_path: Path, path: str, value: float) -> None:
    refused_everywhere(tmp_path, edited(path, value), f"spec.{path}:")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("training.seed", 10**40),
        ("data.seed", 10**40),
        ("training.seed", 2**32),  # the engines seed numpy, which takes 32 bits
        ("training.checkpointInterval", 10**30),
        ("runPolicy.activeDeadlineSeconds", 10**30),
        ("runPolicy.ttlSecondsAfterFinished", 10**30),
        ("optim.warmupSteps", 10**30),
    ],
)
def test_huge_integers_are_refused(tmp_path: Path, path: str, value: int) -> None:
    refused_everywhere(tmp_path, edited(path, value), f"spec.{path}: must be less than or equal")


# --- rewards ------------------------------------------------------------------------------------


def test_unknown_reward_function(tmp_path: Path) -> None:
    refused_everywhere(
        tmp_path, edited("reward.function", "no_such_reward"),
        "spec.reward.function: unknown reward 'no_such_reward'", "math_answer",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("reward", "expected"),
    [
        ({"function": "regex_match", "params": {"patern": "x"}}, "'patern'"),
        ({"function": "regex_match", "params": {"pattern": "("}}, "invalid"),
        ({"function": "length_penalty", "params": {"target": -1}}, "target must be"),
        ({"function": "python_tests", "params": {"memory_mb": "lots"}}, "memory_mb"),
        (
            {"function": "weighted", "params": {"components": [{"name": "nope", "weight": 1}]}},
            "unknown reward 'nope'",
        ),
    ],
    ids=["unknown-param", "bad-regex", "bad-value", "bad-type", "weighted-unknown"],
)
def test_bad_reward_params(tmp_path: Path, reward: dict, expected: str) -> None:
    refused_everywhere(tmp_path, edited("reward", reward), "spec.reward.params: ", expected)


def test_a_reward_model_is_checked_without_loading_it(tmp_path: Path) -> None:
    """Factories are checked by signature: a model path that does not exist here is fine."""
    doc = edited("reward", {"function": "reward_model", "params": {"path": "/nowhere/rm"}})
    code, out = validate_text(tmp_path, yaml.safe_dump(doc))
    assert code == 0, out
    doc = edited("reward", {"function": "reward_model", "params": {"paht": "/nowhere/rm"}})
    refused_by_cli(tmp_path, yaml.safe_dump(doc), "spec.reward.params:", "'paht'")


# --- engine flags -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--api-key", "known"],
        ["--api-key=known"],
        ["--api_key", "known"],
        ["--api-k", "known"],  # argparse takes an unambiguous prefix
        ["--host", "0.0.0.0"],
        ["--port", "1"],
        ["--served-model-name", "other"],
        ["--config", "/tmp/all-flags.yaml"],
        ["--enable-prefix-caching", "--logprobs-mode", "raw_logprobs"],
        ["-tp", "4"],
    ],
)
def test_engine_args_cannot_override_managed_flags(tmp_path: Path, args: list[str]) -> None:
    refused_everywhere(tmp_path, edited("rollout.engineArgs", args), "spec.rollout.engineArgs:")


def test_engine_args_that_add_flags_pass_and_reach_the_command(tmp_path: Path) -> None:
    extra = ["--enable-prefix-caching", "--max-logprobs", "5"]
    doc = edited("rollout.engineArgs", extra)
    code, out = validate_text(tmp_path, yaml.safe_dump(doc))
    assert code == 0, out
    spec = LoRARLJob.model_validate(doc).spec
    assert engine_command(spec, "/m", "127.0.0.1", 8000)[-3:] == extra


def test_the_plan_refuses_managed_flags_even_past_validation() -> None:
    spec = LoRARLJob.model_validate(JOB).spec
    spec.rollout.engine_args = ["--host", "0.0.0.0"]  # as if a caller skipped validation
    with pytest.raises(ValueError, match=r"spec\.rollout\.engineArgs: '--host'"):
        engine_command(spec, "/m", "127.0.0.1", 8000)


@pytest.mark.parametrize(
    "rollout",
    [
        {"engine": "vllm", "gpusPerReplica": 0, "syncMode": "adapter"},
        {"engine": "vllm", "gpusPerReplica": 1, "syncMode": "merged"},
        {"engine": "vllm", "gpusPerReplica": 2, "tensorParallelSize": 2, "syncMode": "adapter"},
        {"engine": "sglang", "gpusPerReplica": 1, "syncMode": "adapter"},
        {"engine": "sglang", "gpusPerReplica": 1, "syncMode": "merged"},
    ],
)
def test_every_flag_the_plan_sets_is_managed(rollout: dict) -> None:
    """The managed lists cannot drift from the commands: a new plan flag must be added there."""
    doc = edited("rollout", rollout)
    doc["spec"]["model"]["trustRemoteCode"] = True
    spec = LoRARLJob.model_validate(doc).spec
    argv = engine_command(spec, "/m", "127.0.0.1", 8000)
    flags = [a for a in argv if a.startswith("--")]
    managed = managed_flags(spec.rollout.engine, cpu=spec.rollout.gpus_per_replica == 0)
    assert flags and set(flags) <= set(managed), set(flags) - set(managed)
    assert all(overriding_arg(spec.rollout.engine, [f], cpu=False) for f in ("--api-key", "--host"))


# --- priority classes ---------------------------------------------------------------------------


def test_system_priority_classes_are_refused_everywhere(tmp_path: Path) -> None:
    doc = edited("scheduling.priorityClassName", "system-node-critical")
    refused_everywhere(tmp_path, doc, "spec.scheduling.priorityClassName:", "system-")


def test_priority_classes_follow_the_operators_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = edited("scheduling.priorityClassName", "batch-high")
    message = webhook_refusal(doc, monkeypatch, allowed_priority_classes=())
    assert "spec.scheduling.priorityClassName: must be a PriorityClass the operator" in message
    assert "none: leave it unset" in message
    message = webhook_refusal(doc, monkeypatch, allowed_priority_classes=("training",))
    assert "(training;" in message and '(got "batch-high")' in message
    monkeypatch.setattr(
        webhook,
        "CONFIG",
        dataclasses.replace(webhook.CONFIG, allowed_priority_classes=("batch-high",)),
    )
    webhook.validate_lorarljob(body=doc, old=None, operation="CREATE")


def test_a_policy_tightened_after_admission_still_lets_the_job_be_deleted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The admin drops a PriorityClass from the list while a job that uses it runs: kopf's
    annotation writes and the finalizer removed on delete (metadata-only updates) still pass,
    so the job can finish and go; an edit of its spec is held to the new list."""
    old = edited("scheduling.priorityClassName", "batch-high")
    old["metadata"]["finalizers"] = ["lorarl.dev/operator"]
    monkeypatch.setattr(
        webhook, "CONFIG", dataclasses.replace(webhook.CONFIG, allowed_priority_classes=())
    )
    deleting = copy.deepcopy(old)
    deleting["metadata"].update(finalizers=[], deletionTimestamp="2026-11-27T00:00:00Z")
    deleting["metadata"]["annotations"] = {"lorarl.dev/last-handled-configuration": "{}"}
    webhook.validate_lorarljob(body=deleting, old=old, operation="UPDATE")
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"] = {"team": "x"}
    with pytest.raises(kopf.AdmissionError, match="priorityClassName"):
        webhook.validate_lorarljob(body=relabelled, old=old, operation="UPDATE")
    scaled = copy.deepcopy(old)
    scaled["spec"]["rollout"]["replicas"] = 3
    with pytest.raises(kopf.AdmissionError, match="priorityClassName"):
        webhook.validate_lorarljob(body=scaled, old=old, operation="UPDATE")
