"""`lorarl validate --deep`: the model's config, module names and tokenizer, an existing adapter
and the data rows, checked before anything starts and without loading a weight."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from lorarl.api.validation import parse_job
from lorarl.cli.main import main
from lorarl.local.tiny import make_tiny_model
from lorarl.model_checks import model_problems

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
LINEAR = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama: 2 attention heads, 1 key-value head."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", "llama", hidden=128)


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    f = tmp_path / "train.jsonl"
    rows = [{"prompt": f"what is {i} + {i}?", "answer": str(2 * i)} for i in range(20)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def job_doc(model_dir: Path, data_file: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(QUICKSTART)
    doc["spec"]["model"]["path"] = str(model_dir)
    doc["spec"]["data"] = {"trainFiles": [str(data_file)], "maxPromptTokens": 64}
    doc["spec"]["reward"] = {"function": "math_answer"}
    for name, value in sections.items():
        doc["spec"].setdefault(name, {}).update(value)
    return doc


def deep(doc: dict[str, Any], *, cluster: bool = False) -> list[str]:
    return model_problems(parse_job(doc, cluster=cluster), cluster=cluster)


def test_a_job_that_fits_its_model_and_data_has_no_problem(model_dir: Path, data_file: Path):
    doc = job_doc(model_dir, data_file, lora={"targetModules": ["q_proj", "v_proj"]})
    assert deep(doc) == []


def test_lora_names_are_checked_against_the_models_modules(model_dir: Path, data_file: Path):
    doc = job_doc(
        model_dir,
        data_file,
        lora={"targetModules": ["q_proj", "qkv_proj", "mlp"], "excludeModules": ["v_prj"]},
    )
    assert deep(doc) == [
        f"spec.lora.targetModules: qkv_proj names no module of the model (its linear layers: "
        f"{LINEAR})",
        "spec.lora.targetModules: mlp names LlamaMLP modules, not linear layers (LoRA adapts "
        f"linear layers: {LINEAR})",
        f"spec.lora.excludeModules: v_prj names no module of the model (its linear layers: "
        f"{LINEAR})",
    ]
    doc = job_doc(
        model_dir, data_file, lora={"targetModules": ["q_proj"], "excludeModules": ["q_proj"]}
    )
    assert deep(doc) == ["spec.lora.excludeModules: leaves no layer of targetModules to adapt"]


@pytest.mark.parametrize(
    ("tp", "expected"), [(2, []), (4, ["must divide the model's 2 attention heads (got 4)"])]
)
def test_tensor_parallelism_must_split_the_attention_heads(model_dir, data_file, tp, expected):
    rollout = {"gpusPerReplica": tp, "tensorParallelSize": tp, "engine": "vllm"}
    doc = job_doc(model_dir, data_file, rollout=rollout)
    del doc["spec"]["rollout"]["kvCacheGib"]  # a CPU-only knob
    assert deep(doc) == [f"spec.rollout.tensorParallelSize: {e}" for e in expected]


def test_an_adapter_of_another_shape_is_refused(model_dir: Path, data_file: Path, tmp_path: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapter = tmp_path / "adapter"
    config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear")
    get_peft_model(base, config).save_pretrained(adapter)
    doc = job_doc(model_dir, data_file, lora={"adapterPath": str(adapter), "rank": 8, "alpha": 16})
    assert deep(doc) == [f"spec.lora.rank: 8 but the adapter at {adapter} says r=4"]
    doc["spec"]["lora"]["rank"] = 4
    assert deep(doc) == []
    doc["spec"]["lora"] = {"adapterPath": str(adapter)}  # rank, alpha, targets: the adapter's
    assert deep(doc) == []
    doc["spec"]["lora"]["targetModules"] = ["q_proj", "v_proj"]
    [problem] = deep(doc)
    assert problem.startswith(
        f"spec.lora.adapterPath: adapter at {adapter} targets different modules than "
        "lora.targetModules"
    )


def test_validate_deep_refuses_an_adapter_conflict(
    model_dir: Path, data_file: Path, tmp_path: Path
):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(adapter)
    manifest = tmp_path / "job.yaml"
    doc = job_doc(model_dir, data_file)
    doc["spec"]["lora"] = {"adapterPath": str(adapter), "alpha": 16}
    manifest.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["validate", "--deep", str(manifest)])
    assert result.exit_code != 0
    assert f"spec.lora.alpha: 16 but the adapter at {adapter} says lora_alpha=8" in result.output
    doc["spec"]["lora"] = {"adapterPath": str(adapter)}
    manifest.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["validate", "--deep", str(manifest)])
    assert result.exit_code == 0, result.output


def test_the_data_rows_and_prompt_lengths_are_checked(model_dir: Path, data_file: Path):
    doc = job_doc(model_dir, data_file)
    doc["spec"]["data"]["promptKey"] = "question"
    [problem] = deep(doc)
    assert problem.startswith(f"spec.data.trainFiles: {data_file}:1: row is missing prompt key")
    doc = job_doc(model_dir, data_file)
    doc["spec"]["data"]["maxPromptTokens"] = 4
    [problem] = deep(doc)
    assert problem.startswith(
        f"spec.data.maxPromptTokens: {data_file}: all 20 prompts are longer than "
        "data.maxPromptTokens=4"
    )


def test_no_weight_is_read(model_dir: Path, data_file: Path, tmp_path: Path):
    """Weights that are not even a safetensors file: loading them would fail, the checks pass."""
    hollow = tmp_path / "hollow"
    hollow.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (hollow / f.name).write_bytes(f.read_bytes())
    (hollow / "model.safetensors").write_bytes(b"not weights")
    assert deep(job_doc(hollow, data_file)) == []
    (hollow / "model.safetensors").unlink()
    assert deep(job_doc(hollow, data_file)) == [
        f"spec.model.path: {hollow} has no *.safetensors weights"
    ]


def test_a_model_that_is_not_on_this_machine_is_skipped(data_file: Path):
    """A cluster job's model is on its claim; the trainer checks it there at start."""
    doc = job_doc(Path("/models/not-here"), data_file)
    doc["spec"]["data"]["maxPromptTokens"] = 1  # would be a problem, with a tokenizer to say so
    assert deep(doc, cluster=True) == [] and deep(doc) == []
    doc["spec"]["data"]["promptKey"] = "question"  # the rows are here: checked all the same
    [problem] = deep(doc)
    assert problem.startswith(f"spec.data.trainFiles: {data_file}:1: row is missing prompt key")


def test_validate_deep_prints_each_problem_and_fails(model_dir, data_file, tmp_path: Path):
    doc = job_doc(model_dir, data_file, lora={"targetModules": ["qkv_proj"]})
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(main, ["validate", "--local", str(f)])
    assert r.exit_code == 0, r.output  # the manifest itself is fine
    r = CliRunner().invoke(main, ["validate", "--deep", "--local", str(f)])
    assert r.exit_code == 1
    assert f"{f}: spec.lora.targetModules: qkv_proj names no module of the model" in r.output


def test_a_ppo_critic_that_keeps_the_actors_targets_is_checked_once(
    model_dir: Path, data_file: Path
):
    """An unset critic list is the actor's (once crashed with a TypeError); a set one is
    checked on its own."""
    doc = job_doc(model_dir, data_file, lora={"targetModules": ["q_proj", "v_proj"]})
    doc["spec"]["algorithm"] = {"name": "ppo", "groupSize": 4}
    doc["spec"]["critic"] = {"lora": {"rank": 4}}
    assert deep(doc) == []
    doc["spec"]["critic"] = {"lora": {"targetModules": ["q_prj"]}}
    assert deep(doc) == [
        f"spec.critic.lora.targetModules: q_prj names no module of the model (its linear "
        f"layers: {LINEAR})"
    ]
