"""`lorarl import verl|skyrl|rlinf FILE`: the public guides' LoRA scripts and configs
(tests/fixtures/porting/, written from their documented parameters) become manifests that
validate and plan, with every value carried or commented, and docs/porting.md is the table the
importer uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from lorarl import importer
from lorarl.api import safe_yaml
from lorarl.api.porting import FOREIGN_NAMES
from lorarl.api.spec.job import ModelSpec
from lorarl.api.validation import check_manifest, load_job_file, parse_job
from lorarl.cli.main import main
from lorarl.plan import plan

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "porting"
ENV = {"HOME": "/home/user"}


def _hub_ids_accepted() -> bool:
    try:
        ModelSpec.model_validate({"path": "Qwen/Qwen2.5-3B-Instruct"})
    except ValueError:
        return False
    return True


HUB_IDS = _hub_ids_accepted()


def imported(name: str, framework: str, **kw: Any) -> tuple[dict[str, Any], str]:
    """(the manifest as read back from the written YAML, the YAML text)."""
    result = importer.import_script((FIXTURES / name).read_text(), framework, env=ENV, **kw)
    text = importer.render(result, name)
    [doc] = safe_yaml.load_all(text)
    assert doc == result.manifest  # the comments and layout change nothing
    assert check_manifest(doc) == []  # as `lorarl validate` (cluster rules) reads it
    plan(parse_job(doc, cluster=True))
    return doc, text


def comments(text: str) -> str:
    """The comment text, lines joined (a long comment wraps)."""
    lines = [line.strip()[1:].strip() for line in text.splitlines() if line.strip()[:1] == "#"]
    return " ".join(lines)


def test_verl_gsm8k_grpo_lora_script_carries_its_settings_converted():
    doc, text = imported("verl_gsm8k_grpo_lora.sh", "verl")
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "qwen2-5-3b-grpo-lora"  # trainer.experiment_name
    assert spec["lora"] == {"rank": 64, "alpha": 32, "targetModules": ["all-linear"]}
    assert spec["algorithm"]["name"] == "grpo"
    assert spec["algorithm"]["groupSize"] == 5
    assert spec["algorithm"]["kl"] == {"coef": 0.001, "estimator": "low_var_kl", "inReward": False}
    assert spec["optim"]["lr"] == 3e-6
    training = spec["training"]
    assert training["promptsPerStep"] == 1024
    assert training["miniBatchSize"] == 256 * 5  # verl counts prompts, lorarl samples
    assert training["microBatchSize"] == 40
    assert (training["checkpointInterval"], training["evalInterval"]) == (20, 5)
    assert spec["data"]["trainFiles"] == ["/home/user/data/gsm8k/train.parquet"]  # $HOME
    assert spec["data"]["valFiles"] == ["/home/user/data/gsm8k/test.parquet"]
    assert spec["data"]["answerKey"] == "reward_model.ground_truth"
    assert (spec["data"]["maxPromptTokens"], spec["data"]["maxResponseTokens"]) == (512, 1024)
    assert spec["data"]["shuffle"] is False
    assert spec["rollout"]["engine"] == "vllm"
    assert spec["rollout"]["tensorParallelSize"] == spec["rollout"]["gpusPerReplica"] == 2
    assert spec["rollout"]["memoryFraction"] == 0.6
    assert spec["logging"] == {
        "backends": ["wandb"],
        "wandb": {"project": "verl_grpo_example_gsm8k"},
        "runName": "qwen2.5_3b_grpo_lora",  # the tracker run keeps the name as written
    }
    assert (spec["trainer"]["gpusPerReplica"], spec["trainer"]["replicas"]) == (8, 1)
    assert spec["reward"] == {"function": "gsm8k"}
    said = comments(text)
    if HUB_IDS:  # model.path takes a hub id: kept as written
        assert spec["model"]["path"] == "Qwen/Qwen2.5-3B-Instruct"
    else:  # a local folder on a claim, and a comment saying what to do
        assert spec["model"]["path"] == "/models/Qwen2.5-3B-Instruct"
        assert "was Qwen/Qwen2.5-3B-Instruct, a Hugging Face hub id" in said
    assert "ppo_mini_batch_size=256 prompts x groupSize 5" in said
    assert "trainer.experiment_name: also metadata.name, as a DNS name" in said
    assert "trainer.experiment_name=" not in said  # carried, not listed as dropped
    # what is not carried is a comment with the reason
    for expected in (
        "actor_rollout_ref.model.use_shm=True: the model is read from spec.model.path",
        "actor_rollout_ref.rollout.layered_summon=True: weights reach the engines",
    ):
        assert expected in said, expected
    # epochs: the trainer counts the steps from the data (rounding up where verl drops)
    assert training["epochs"] == 15 and "totalSteps" not in training
    assert "trainer.total_epochs=15: the trainer runs ceil(epochs x rows / promptsPerStep)" in said
    # memory settings: checkpointing on, offload off as the script says
    assert spec["trainer"]["activationCheckpointing"] is True
    assert spec["trainer"]["fsdp"] == {"offloadParams": False}


def test_verl_72b_reference_config_with_offload_tp8_and_a_reward_file():
    doc, text = imported("verl_72b_lora.sh", "verl", default_name="verl_72b_lora")
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "verl-72b-lora"
    assert spec["lora"]["targetModules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert spec["optim"] == {"lr": 3e-5, "scheduler": "cosine"}
    assert spec["rollout"]["tensorParallelSize"] == spec["rollout"]["gpusPerReplica"] == 8
    assert spec["rollout"]["engine"] == "vllm"  # ${1:-vllm}
    assert spec["data"]["trainFiles"] == ["/mnt/data/gsm8k/train.parquet"]  # ${DATA_DIR:-...}
    assert spec["training"]["totalSteps"] == 200
    assert "epochs" not in spec["training"]
    assert spec["trainer"]["fsdp"] == {"offloadParams": True}  # param_offload + optimizer_offload
    assert spec["trainer"]["activationCheckpointing"] is True
    assert spec["training"]["miniBatchSize"] == 16 * 5
    assert spec["reward"] == {"entrypoint": "/rewards/gsm8k_verl.py:compute_score"}
    assert "logging" not in spec  # console only: always on
    said = comments(text)
    for expected in (
        "actor_rollout_ref.rollout.max_num_batched_tokens=2048: an engine flag",
        "actor_rollout_ref.rollout.some_future_knob=7: no lorarl setting known",
        "$CKPT_ROOT: the script uses it without setting it",
        "trainer.default_local_dir=$CKPT_ROOT/qwen72b: holds an unset shell variable",
    ):
        assert expected in said, expected


def test_skyrl_gsm8k_lora_example():
    doc, text = imported("skyrl_gsm8k_lora.sh", "skyrl")
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "gsm8k-0-5b-lora-test"
    assert spec["lora"] == {"rank": 32, "alpha": 32, "targetModules": ["all-linear"]}
    assert spec["algorithm"]["name"] == "grpo"
    assert spec["algorithm"]["groupSize"] == 4
    assert spec["algorithm"]["kl"] == {"coef": 0.001}
    assert spec["optim"] == {"lr": 3e-5}
    assert spec["training"]["miniBatchSize"] == 256 * 4
    assert spec["training"]["promptsPerStep"] == 1024
    assert spec["training"]["evalBeforeTrain"] is True
    assert spec["data"]["trainFiles"] == ["/home/user/data/gsm8k/train.parquet"]
    assert spec["data"]["answerKey"] == "reward_spec.ground_truth"
    assert spec["data"]["maxResponseTokens"] == 1024
    assert spec["reward"] == {"function": "gsm8k"}  # environment.env_class=gsm8k
    rollout = spec["rollout"]
    assert rollout["placement"] == "colocated"
    assert rollout["gpusPerReplica"] == rollout["tensorParallelSize"] == 4
    assert spec["trainer"]["gpusPerReplica"] == 4
    assert spec["training"]["epochs"] == 20
    assert spec["training"]["resume"] == "never"  # resume_mode=null
    said = comments(text)
    assert "generator.weight_sync_backend=nccl: weights reach the engines" in said
    assert "trainer.ckpt_path" not in said or "training.outputDir=" in said
    assert "training.outputDir=/home/user/ckpts/gsm8k_0.5B_lora_ckpt: outputs go under" in said


def test_a_local_import_validates_for_run_local(tmp_path: Path):
    src = (FIXTURES / "verl_gsm8k_grpo_lora.sh").read_text()
    result = importer.import_script(src, "verl", env=ENV, cluster=False)
    assert "volume" not in result.manifest["spec"]["training"]
    assert check_manifest(result.manifest, cluster=False) == []
    out = tmp_path / "job.yaml"
    out.write_text(importer.render(result))
    load_job_file(out)


def test_one_offload_flag_turns_lorarls_single_offload_on_with_a_note():
    script = (
        "python3 -m verl.trainer.main_ppo data.train_files=/d/train.parquet "
        "actor_rollout_ref.actor.fsdp_config.param_offload=True "
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False\n"
    )
    result = importer.import_script(script, "verl")
    assert result.manifest["spec"]["trainer"]["fsdp"] == {"offloadParams": True}
    [note] = result.notes["spec.trainer.fsdp.offloadParams"]
    assert "offload together" in note


def test_dynamic_batch_size_carries_the_token_budget():
    script = (
        "python3 -m verl.trainer.main_ppo data.train_files=/d/train.parquet "
        "actor_rollout_ref.actor.use_dynamic_bsz=True "
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384\n"
    )
    result = importer.import_script(script, "verl")
    assert result.manifest["spec"]["training"]["maxTokensPerMicroBatch"] == 16384


def test_kl_loss_off_is_coef_zero_and_its_coef_a_comment():
    script = (
        "python3 -m verl.trainer.main_ppo data.train_files=/d/train.parquet "
        "actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.kl_loss_coef=0.01\n"
    )
    result = importer.import_script(script, "verl")
    assert result.manifest["spec"]["algorithm"]["kl"] == {"coef": 0.0}
    assert any(k == "actor_rollout_ref.actor.kl_loss_coef" for k, _, _ in result.uncarried)


def test_unknown_keys_and_refused_values_never_crash_and_the_result_validates():
    script = """#!/bin/bash
    # a comment with key=value in it
    export FOO=bar
    python3 -m verl.trainer.main_ppo --config-path=conf \\
      data.train_files="['/d/a.parquet','/d/b.parquet']" \\
      actor_rollout_ref.actor.optim.lr=abc \\
      actor_rollout_ref.rollout.n=-3 \\
      actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
      data.train_batch_size=[1,2] \\
      trainer.total_epochs=x \\
      trainer.resume_mode=resume_path \\
      actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 \\
      algorithm.adv_estimator=weird \\
      actor_rollout_ref.rollout.name=hf \\
      actor_rollout_ref.model.lora_rank=100000 \\
      +some.new.key=1 ~other.key totally_unknown=$FOO \\
      custom_reward_function.name=my_fn \\
      trainer.logger=[console,swanlab]
    """
    result = importer.import_script(script, "verl")
    assert check_manifest(result.manifest) == []
    spec = result.manifest["spec"]
    assert spec["data"]["trainFiles"] == ["/d/a.parquet", "/d/b.parquet"]
    skipped = {key: why for key, _, why in result.uncarried}
    assert "some.new.key" in skipped and "totally_unknown" in skipped
    assert skipped["algorithm.adv_estimator"].startswith("lorarl's algorithms are")
    assert skipped["actor_rollout_ref.rollout.name"] == "lorarl's engines are vllm and sglang"
    assert skipped["trainer.logger"].startswith("lorarl's backends are")
    assert "custom_reward_function.name" in skipped  # a name without its path
    assert skipped["trainer.resume_mode"].startswith("resuming from a given checkpoint path")
    assert skipped["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == (
        "applies with use_dynamic_bsz=True only"
    )
    for refused in ("spec.optim.lr", "spec.algorithm.groupSize", "spec.lora.rank",
                    "spec.training.promptsPerStep", "spec.training.epochs"):  # fmt: skip
        assert skipped[refused].startswith("refused by lorarl:"), refused
    assert "lr" not in spec.get("optim", {})
    text = importer.render(result)
    assert safe_yaml.load_all(text) == [result.manifest]


def test_a_file_without_the_trainer_command_is_one_clear_error(tmp_path: Path):
    f = tmp_path / "run.sh"
    f.write_text("echo hello\n")
    with pytest.raises(importer.ScriptError, match=r"no `python -m verl\.trainer\.main_ppo`"):
        importer.import_script(f.read_text(), "verl")
    r = CliRunner().invoke(main, ["import", "skyrl", str(f)])
    assert r.exit_code == 1
    assert r.output.strip().startswith(f"Error: {f}: no `python -m skyrl_train")


def test_the_cli_writes_a_manifest_lorarl_validate_accepts(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/user")
    monkeypatch.setenv("CKPT_ROOT", "/ckpt")
    out = tmp_path / "job.yaml"
    runner = CliRunner()
    r = runner.invoke(main, ["import", "verl", str(FIXTURES / "verl_72b_lora.sh"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "parameters not carried" in r.output
    assert "$CKPT_ROOT" not in out.read_text()  # from the environment
    r = runner.invoke(main, ["validate", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["plan", str(out)])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["import", "verl"])
    assert r.exit_code == 2
    r = runner.invoke(main, ["import", "--table"])
    assert r.exit_code == 0 and r.output == importer.porting_tables()


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("True", True), ("false", False), ("null", None), ("64", 64), ("3e-6", 3e-6),
        ("0.6", 0.6), ("all-linear", "all-linear"), ("'error'", "error"),
        ('["console","wandb"]', ["console", "wandb"]), ("[q_proj,v_proj]", ["q_proj", "v_proj"]),
        ("[]", []), ("Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-3B-Instruct"),
    ],
)  # fmt: skip
def test_hydra_values_are_typed_as_hydra_types_them(raw: str, value: Any):
    assert importer.hydra_value(raw) == value


def test_every_conversion_the_table_names_exists():
    for entry in FOREIGN_NAMES:
        assert entry.convert in importer.CONVERSIONS, entry


def test_docs_porting_md_is_the_generated_table():
    doc = (ROOT / "docs" / "porting.md").read_text()
    assert importer.update_doc(doc, str(ROOT)) == doc, (
        "docs/porting.md is stale: run `lorarl import --table -o docs/porting.md`"
    )
    assert (
        "| `actor_rollout_ref.actor.ppo_mini_batch_size` | `spec.training.miniBatchSize` |" in doc
    )
    assert "| SkyRL | `generator.weight_sync_backend` |" in doc


def test_verl_megatron_lora_block_maps_its_lora_and_drops_megatron_parallelism():
    doc, text = imported("verl_megatron_lora.sh", "verl")
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "qwen2-7b-megatron-lora"
    # lora.* (Megatron's block), its fused layer names in Hugging Face's
    assert spec["lora"] == {
        "rank": 32,
        "alpha": 64,
        "dropout": 0.05,
        "targetModules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"],
    }  # fmt: skip
    assert spec["trainer"]["fsdp"] == {"offloadParams": True}  # megatron.*_offload
    assert spec["data"]["trainFiles"] == [
        "/home/user/data/gsm8k/train.parquet",
        "/home/user/data/math/train.parquet",
    ]
    assert spec["training"]["miniBatchSize"] == 32 * 8
    assert spec["optim"] == {"lr": 2e-5, "weightDecay": 0.01, "gradClip": 1.0}
    said = comments(text)
    assert "Megatron's fused layers, in the Hugging Face module names" in said
    assert spec["reward"] == {"function": "math_answer"}
    assert "the data mixes GSM8K with other sources" in said
    for expected in (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2: lorarl's trainer is FSDP2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2: lorarl's trainer is",
        "actor_rollout_ref.actor.megatron.sequence_parallel=True: lorarl has no sequence",
        "actor_rollout_ref.ref.megatron.param_offload=True: the reference policy is the base",
        "actor_rollout_ref.model.lora.type=lora: lorarl trains a LoRA adapter",
    ):
        assert expected in said, expected


def test_matpo_multi_turn_job_becomes_a_tool_calling_environment():
    doc, text = imported("matpo_multi_turn.sh", "verl")
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "qwen3-4b-matpo-musique-lora"
    assert spec["environment"] == {
        "entrypoint": "tool_calling",
        "maxTurns": 8,  # multi_turn.max_assistant_turns
        "params": {"max_calls_per_turn": 2, "max_response_chars": 4096},
        "maxTotalTokens": 16384,  # verl's max_response_length bounds the whole episode
    }
    assert spec["lora"] == {"rank": 32, "alpha": 64, "targetModules": ["all-linear"]}
    assert spec["rollout"]["engine"] == "sglang"
    assert spec["training"]["maxTokensPerMicroBatch"] == 24576  # use_dynamic_bsz=True
    assert spec["training"]["samplesInterval"] == 1  # trainer.rollout_data_dir
    assert spec["training"]["resume"] == "never"  # resume_mode=disable
    assert spec["trainer"]["replicas"] == 2  # ${WORKER_NUM:-2}
    said = comments(text)
    assert "the script's tools (/workspace/MATPO/examples" in said
    for expected in (
        "multi_turn.tool_config_path=/workspace/MATPO",
        "multi_turn.enable_final_summary=True: MATPO's sub-agent summaries",
        "data.return_raw_chat=True: episodes always start from the prompt's chat messages",
        "trainer.validation_data_dir=/workspace/MATPO/val_rollouts/qwen3-4b-matpo-musique-lora: "
        "every eval's completions are kept",
    ):
        assert expected in said, expected


def test_multi_turn_settings_without_multi_turn_on_are_comments():
    script = (
        "python3 -m verl.trainer.main_ppo data.train_files=/d/train.parquet "
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5\n"
    )
    result = importer.import_script(script, "verl")
    assert "environment" not in result.manifest["spec"]
    [(_key, _, why)] = result.uncarried
    assert why == "applies with actor_rollout_ref.rollout.multi_turn.enable=True only"


def test_rlinf_math_lora_config_is_read_as_yaml():
    doc, text = imported("rlinf_math_lora.yaml", "rlinf")
    spec = doc["spec"]
    assert doc["metadata"]["name"] == "grpo-1-5b-lora"  # runner.experiment_name
    assert spec["model"]["path"] == "/models/DeepSeek-R1-Distill-Qwen-1.5B"
    assert spec["model"]["trustRemoteCode"] is True
    assert spec["lora"] == {"rank": 32}  # actor.model.is_lora / lora_rank
    assert spec["algorithm"]["name"] == "grpo"
    assert spec["algorithm"]["groupSize"] == 8
    assert spec["optim"]["betas"] == [0.9, 0.95]  # adam_beta1, adam_beta2
    assert spec["data"]["maxResponseTokens"] == 8192 - 1024  # seq_length - max_prompt_length
    assert spec["data"]["answerKey"] == "solutions"
    assert spec["training"]["promptsPerStep"] == 128
    assert spec["training"]["miniBatchSize"] == 128 * 8 // 4  # n_minibatches=4
    assert spec["training"]["epochs"] == 3 and "totalSteps" not in spec["training"]
    assert spec["rollout"]["placement"] == "colocated"  # actor,rollout,reward: all
    assert spec["rollout"]["sampling"]["topK"] == -1  # 1000000: off
    assert spec["reward"] == {"function": "math_answer"}  # reward_type: math
    assert spec["logging"]["runName"] == "grpo-1.5b-lora"  # ${runner.experiment_name}
    said = comments(text)
    assert "rollout.pipeline_parallel_size=1: lorarl's engines shard by tensor parallelism" in said
    assert "max_new_tokens" not in said  # RLinf's ${subtract:...} of seq_length: carried by it


def test_the_cli_imports_an_rlinf_config(tmp_path: Path):
    out = tmp_path / "job.yaml"
    runner = CliRunner()
    src = str(FIXTURES / "rlinf_math_lora.yaml")
    r = runner.invoke(main, ["import", "rlinf", src, "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_text().startswith("# Imported by `lorarl import` from RLinf")
    r = runner.invoke(main, ["validate", str(out)])
    assert r.exit_code == 0, r.output


def test_an_rlinf_config_is_flattened_as_hydra_names_it():
    text = """
defaults: [../training_backend/fsdp@actor.fsdp_config]
hydra: {run: {dir: .}}
runner: {experiment_name: exp, seq_length: 4096}
algorithm:
  group_size: 4
  sampling_params:
    n: ${..group_size}
    max_new_tokens: ${subtract:1, 2}
actor: {model: {lora_path: null, name: "${runner.experiment_name}"}}
"""
    assert importer.read_config(text) == [
        ("runner.experiment_name", "exp", "exp"),
        ("runner.seq_length", "4096", 4096),
        ("algorithm.group_size", "4", 4),
        ("algorithm.sampling_params.n", "4", 4),  # relative: one level up
        ("algorithm.sampling_params.max_new_tokens", "${subtract:1, 2}", "${subtract:1, 2}"),
        ("actor.model.name", "exp", "exp"),
    ]


def test_an_rlinf_file_that_is_not_a_config_is_one_clear_error():
    with pytest.raises(importer.ScriptError, match="is this an RLinf config"):
        importer.import_script("just: text\n", "rlinf")
    with pytest.raises(importer.ScriptError, match="not YAML"):
        importer.import_script("a: [\n", "rlinf")


# The five public LoRA examples of issue 37 (verl's GSM8K script and 72B reference config as one
# guide's two jobs, counted apart here), as the fixtures write them.
PORTS = [
    ("verl_gsm8k_grpo_lora.sh", "verl"),
    ("verl_72b_lora.sh", "verl"),
    ("verl_megatron_lora.sh", "verl"),
    ("skyrl_gsm8k_lora.sh", "skyrl"),
    ("rlinf_math_lora.yaml", "rlinf"),
    ("matpo_multi_turn.sh", "verl"),
]
# Left out for the value as a fixture writes it, not for a missing setting: the 72B fixture's
# unset $CKPT_ROOT (and the value using it) and its deliberately unknown knob; a critic setting in
# a job without a critic; the output folder (a cluster job writes to training.volume); SkyRL's
# engine count when engines are colocated.
_VALUE_SKIPS = {
    "$CKPT_ROOT", "trainer.default_local_dir", "actor_rollout_ref.rollout.some_future_knob",
    "trainer.critic_warmup", "training.outputDir", "rollout.replicas",
}  # fmt: skip


def _doc_rows(doc: str, title: str) -> set[tuple[str, str]]:
    section = doc.split(f"### {title}\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    return {
        (cells[1].strip(), cells[2].strip().strip("`"))
        for line in section.splitlines()
        if (cells := line.split("|")) and len(cells) > 3 and cells[2].strip().startswith("`")
    }


def test_every_parameter_of_the_five_ports_is_carried_or_in_the_docs_tables():
    """What the import cannot carry is exactly what docs/porting.md lists: the "No equivalent"
    table holds what cannot apply to lorarl's design, "Needs none" what lorarl does without."""
    doc = (ROOT / "docs" / "porting.md").read_text()
    needs_none, cannot = _doc_rows(doc, "Needs none"), _doc_rows(doc, "No equivalent")
    assert needs_none and cannot
    table = {(e.framework, e.name): e for e in FOREIGN_NAMES}
    total = carried = other = 0
    none_seen: list[tuple[str, str]] = []
    cannot_seen: list[tuple[str, str]] = []
    for name, framework in PORTS:
        text = (FIXTURES / name).read_text()
        fw = importer.FRAMEWORKS[framework]
        if fw == importer.RLINF:
            params = [k for k, _, _ in importer.read_config(text)]
        else:
            params = [k for k, _ in importer.read_overrides(text, fw, ENV)[0]]
        result = importer.import_script(text, framework, env=ENV)
        skipped = {key for key, _, _ in result.uncarried}
        assert skipped <= set(params) | _VALUE_SKIPS, name
        for key in skipped & set(params):
            entry = table.get((fw, key))
            assert entry is not None or key in _VALUE_SKIPS, f"{name}: {key} is in no table"
            if entry is None or entry.field is not None:
                other += 1  # a table entry, its value not carried (see _VALUE_SKIPS)
                assert key in _VALUE_SKIPS, f"{name}: {key}"
                continue
            (cannot_seen if entry.cannot_apply else none_seen).append((fw, key))
            assert (fw, key) in (cannot if entry.cannot_apply else needs_none), key
        total += len(params)
        carried += len(set(params) - skipped)
    assert total == carried + len(none_seen) + len(cannot_seen) + other
    # docs/porting.md says these numbers (its "Measured on the six jobs" paragraph)
    counts = (total, carried, len(none_seen), len(cannot_seen), other)
    for said in (f"{total} parameters", f"{carried} carry", f"{len(none_seen)} need none",
                 f"{len(cannot_seen)} cannot apply", f"{other} are left out"):  # fmt: skip
        assert said in " ".join(doc.split()), counts
