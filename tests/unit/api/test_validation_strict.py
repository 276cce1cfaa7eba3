"""`lorarl validate` is as strict as the API server, and says what was meant.

The CRD declares camelCase keys and typed values, so the API server refuses `total_steps` and
`rank: "16"`; pydantic's lax reading would take both. These tests hold `validate`, `run`/`plan`
(parse_job) and the webhook to the server's reading, and check the hint each refusal carries.
(tests/cluster/test_crd.py sends the same cases to a real API server: harness/cluster/crd_cases.py.)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from click.testing import CliRunner

from lorarl.api import safe_yaml
from lorarl.api.crd import openapi_schema
from lorarl.api.porting import FOREIGN_NAMES
from lorarl.api.resource import rendered_config
from lorarl.api.spec.job import LoRARLJobSpec
from lorarl.api.validation import (
    ManifestError,
    check_manifest,
    load_job_file,
    parse_job,
    validate_manifest,
)
from lorarl.cli.main import main
from lorarl.operator.handlers import webhook

ROOT = Path(__file__).resolve().parents[3]
JOB: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "quickstart-cluster.yaml").read_text())


def edited(path: str, value: Any) -> dict[str, Any]:
    """The cluster quickstart with `value` at the dotted `path` under spec."""
    doc = copy.deepcopy(JOB)
    node = doc["spec"]
    *parents, last = path.split("/")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return doc


def problems(doc: dict[str, Any]) -> list[str]:
    return [str(p) for p in check_manifest(doc)]


def test_the_baseline_is_valid():
    assert problems(JOB) == []


# --- keys ---------------------------------------------------------------------------------------


def test_a_snake_case_key_is_refused_with_its_camel_case_name():
    doc = edited("training/total_steps", 7)
    del doc["spec"]["training"]["totalSteps"]  # alone, pydantic's by-name reading accepted it
    assert problems(doc) == [
        "spec.training.total_steps: unknown field (did you mean totalSteps? manifest fields "
        "are camelCase)"
    ]
    with pytest.raises(ManifestError, match="did you mean totalSteps"):
        parse_job(doc, cluster=True)  # what `lorarl run` and `plan` read with
    # A model built in Python may still use field names (only manifests are held to the wire).
    training = {k: v for k, v in JOB["spec"]["training"].items() if k != "totalSteps"}
    spec = LoRARLJobSpec.model_validate({**JOB["spec"], "training": {**training, "total_steps": 7}})
    assert spec.training.total_steps == 7


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("training/totalStep", "spec.training.totalStep: unknown field (did you mean totalSteps?)"),
        ("Lora", "spec.Lora: unknown field (did you mean lora?)"),
        ("rank", "spec.rank: unknown field (did you mean spec.lora.rank?)"),
        ("lr", "spec.lr: unknown field (did you mean spec.optim.lr?)"),
        (
            "rollout/tempurature",
            "spec.rollout.tempurature: unknown field (did you mean "
            "spec.rollout.sampling.temperature?)",
        ),
        (
            "model/name",
            "spec.model.name: unknown field (known fields: path, revision, hub, volume, dtype, "
            "trustRemoteCode)",
        ),
    ],
)
def test_an_unknown_key_names_the_field_it_probably_is(path: str, expected: str):
    value = {"rank": 8} if path == "Lora" else 1
    assert expected in problems(edited(path, value))


# --- verl and SkyRL names -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("lora/lora_rank", "(did you mean spec.lora.rank? that is verl's and RLinf's lora_rank)"),
        ("lora_alpha", "(did you mean spec.lora.alpha? that is verl's lora_alpha)"),
        (
            "kl_loss_coef",
            "(did you mean spec.algorithm.kl.coef? that is verl's and SkyRL's kl_loss_coef)",
        ),
        ("rollout/n", "(did you mean spec.algorithm.groupSize? that is verl's rollout.n)"),
        (
            "data/max_response_length",
            "(did you mean spec.data.maxResponseTokens? that is verl's data.max_response_length)",
        ),
        (
            "training/ppo_mini_batch_size",
            "(did you mean spec.training.miniBatchSize? that is verl's ppo_mini_batch_size, "
            "which counts prompts, where miniBatchSize counts samples (prompts x "
            "spec.algorithm.groupSize))",
        ),
        (
            "actor_rollout_ref.actor.optim.lr",
            "(did you mean spec.optim.lr? that is verl's actor_rollout_ref.actor.optim.lr)",
        ),
        (  # the critic's, where the key was written in the critic's section
            "critic/lora/lora_rank",
            "(did you mean spec.critic.lora.rank? that is verl's lora_rank)",
        ),
        (
            "use_shm",
            "(verl's use_shm has no lorarl equivalent: the model is read from spec.model.path",
        ),
    ],
)
def test_a_verl_or_skyrl_name_maps_to_its_lorarl_field(path: str, expected: str):
    found = problems(edited(path, 8))
    assert any(expected in p for p in found), found


def test_a_verl_config_tree_lists_where_each_setting_goes():
    tree = {
        "model": {"lora_rank": 16, "target_modules": "all-linear"},
        "actor": {"optim": {"lr": 1e-6}},
        "rollout": {"n": 5},
    }
    [problem] = problems(edited("actor_rollout_ref", tree))
    assert problem == (
        "spec.actor_rollout_ref: unknown field (verl's settings: "
        "actor_rollout_ref.model.lora_rank is spec.lora.rank, "
        "actor_rollout_ref.model.target_modules is spec.lora.targetModules, "
        "actor_rollout_ref.actor.optim.lr is spec.optim.lr, "
        "actor_rollout_ref.rollout.n is spec.algorithm.groupSize)"
    )
    skyrl = {"n_samples_per_prompt": 4, "sampling_params": {"max_generate_length": 512}}
    [problem] = problems(edited("generator", skyrl))
    assert "SkyRL's settings: generator.n_samples_per_prompt is spec.algorithm.groupSize" in problem
    assert "generator.sampling_params.max_generate_length is spec.data.maxResponseTokens" in problem


def test_every_ported_name_points_at_a_field_the_crd_has():
    """A renamed field cannot leave a hint that sends users to a field that does not exist."""
    schema = openapi_schema()
    for entry in FOREIGN_NAMES:
        if entry.field is None:
            assert entry.note, entry.name  # no equivalent: the hint says why
            continue
        node: dict[str, Any] | None = schema
        for part in entry.field.split("."):
            node = (node or {}).get("properties", {}).get(part)
        assert node is not None, f"{entry.framework} {entry.name} -> {entry.field}"


# --- values -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "lora/rank",
            "16",
            'spec.lora.rank: must be an integer, not a string: write 16 without quotes (got "16")',
        ),
        (
            "optim/lr",
            "1e-6",
            'spec.optim.lr: must be a number, not a string: write 1e-6 without quotes (got "1e-6")',
        ),
        (
            "data/shuffle",
            "yes",
            "spec.data.shuffle: must be true or false, not a string: write true without quotes "
            '(got "yes")',
        ),
        ("data/shuffle", 1, "spec.data.shuffle: must be true or false (got 1)"),
        ("lora/rank", True, "spec.lora.rank: must be an integer (got true)"),
        ("lora/rank", "eight", 'spec.lora.rank: must be an integer (got "eight")'),
        ("lora/rank", 16.5, "spec.lora.rank: must be an integer (got 16.5)"),
    ],
)
def test_a_value_of_the_wrong_json_type_is_refused_naming_the_field(path, value, expected):
    assert problems(edited(path, value)) == [expected]


def test_a_whole_float_is_an_integer_as_the_api_server_reads_it():
    """kubectl sends `rank: 16.0` as 16, and the server accepts a JSON 16.0 for an integer."""
    doc = edited("lora/rank", 16.0)
    doc["spec"]["trainer"]["resources"] = {"limits": {"cpu": 4.0, "memory": "8Gi"}}
    before = copy.deepcopy(doc)
    job = parse_job(doc, cluster=True)
    assert job.spec.lora.rank == 16 and isinstance(job.spec.lora.rank, int)
    assert job.spec.trainer.resources.limits["cpu"] == 4
    assert doc == before  # the caller's manifest is not rewritten
    # A free-form mapping (no schema types) is kept as written.
    doc = edited("data/chatTemplateKwargs", {"budget": 2.0})
    assert validate_manifest(doc, None).spec.data.chat_template_kwargs == {"budget": 2.0}


def test_yaml_exponent_floats_read_as_kubectl_reads_them(tmp_path: Path):
    """PyYAML (YAML 1.1) reads `1e-6` as a string; go-yaml (kubectl) as a number."""
    text = (ROOT / "examples" / "quickstart-cluster.yaml").read_text()
    text = text.replace("lr: 3.0e-3", "lr: 3e-3")
    assert "lr: 3e-3" in text
    f = tmp_path / "job.yaml"
    f.write_text(text)
    r = CliRunner().invoke(main, ["validate", str(f)])
    assert r.exit_code == 0, r.output
    assert safe_yaml.load_all("a: 1e-6\nb: 1.5E+3\nc: '1e3'\nd: 1e\n") == [
        {"a": 1e-6, "b": 1500.0, "c": "1e3", "d": "1e"}
    ]


def test_a_string_that_reads_as_a_number_stays_a_string_in_the_rendered_config(tmp_path: Path):
    """The config every process reads is written by lorarl and read back strictly: a quantity
    written "1e3" must come back a string, not the float go-yaml and lorarl read it as."""
    doc = edited("trainer/resources", {"limits": {"ephemeral-storage": "1e3", "memory": "8Gi"}})
    job = parse_job(doc, cluster=True)
    text = safe_yaml.dump(rendered_config(job))
    assert "ephemeral-storage: '1e3'" in text
    f = tmp_path / "job.yaml"
    f.write_text(text)
    assert load_job_file(f).spec.trainer.resources.limits["ephemeral-storage"] == "1e3"


# --- one code path ------------------------------------------------------------------------------


def test_the_webhook_refuses_with_the_words_validate_prints(tmp_path: Path):
    doc = edited("training/total_steps", 7)
    doc["spec"]["lora"]["rank"] = "16"
    doc["spec"]["lora_alpha"] = 16
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(main, ["validate", str(f)])
    assert r.exit_code == 1
    printed = [line.removeprefix(f"{f}: ") for line in r.output.splitlines()]
    assert len(printed) == 3, printed
    with pytest.raises(kopf.AdmissionError) as refused:
        webhook.validate_lorarljob(body=doc, old=None, operation="CREATE")
    assert str(refused.value) == "; ".join(printed)
    assert "spec.lora.rank: must be an integer, not a string" in str(refused.value)
    assert "spec.lora_alpha: unknown field (did you mean spec.lora.alpha?" in str(refused.value)


def test_many_unknown_keys_stay_a_short_answer():
    doc = copy.deepcopy(JOB)
    for i in range(2000):
        doc["spec"][f"k{i:05d}_" + "x" * 58] = {"lora_rank": i}
    found = problems(doc)
    assert len(found) == 21 and found[-1] == "... and 1980 more problems"
