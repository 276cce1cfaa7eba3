"""spec.lora with adapterPath (issue 37): the adapter's own adapter_config.json supplies what the
spec leaves unset, and a field the spec sets to another value is refused, naming both."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from lorarl.api.spec.lora import (
    AdapterConfigError,
    LoraSpec,
    LoraValues,
    merge_adapter_config,
    rank_here,
    read_adapter_config,
    values_here,
)

PEFT = {
    "peft_type": "LORA",
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "target_modules": ["v_proj", "q_proj"],
    "exclude_modules": None,
    "use_rslora": True,
}

ROOT = Path(__file__).resolve().parents[3]


def test_unset_fields_take_the_adapters_values():
    got = merge_adapter_config(LoraSpec(adapter_path="/a"), PEFT)
    assert got == LoraValues(
        rank=8, alpha=16.0, dropout=0.05, target_modules=("q_proj", "v_proj"),
        exclude_modules=(), use_rslora=True, adapter_path="/a",
    )  # fmt: skip


def test_fields_set_to_the_adapters_values_are_no_conflict():
    spec = LoraSpec(
        adapter_path="/a", rank=8, alpha=16, dropout=0.05, use_rslora=True,
        target_modules=["all-linear"],
    )  # fmt: skip
    got = merge_adapter_config(spec, PEFT)
    # targets are the spec's: whether they mean the adapter's modules takes the model
    assert (got.rank, got.alpha, got.target_modules) == (8, 16.0, ("all-linear",))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rank", 16, "spec.lora.rank: 16 but the adapter at /a says r=8"),
        ("alpha", 32, "spec.lora.alpha: 32 but the adapter at /a says lora_alpha=16"),
        (
            "use_rslora",
            False,
            "spec.lora.useRslora: false but the adapter at /a says use_rslora=true",
        ),
    ],
)
def test_a_conflict_names_the_field_and_both_values(field, value, message):
    with pytest.raises(AdapterConfigError) as err:
        merge_adapter_config(LoraSpec(adapter_path="/a", **{field: value}), PEFT)
    assert str(err.value) == message


def test_without_an_adapter_unset_fields_take_the_defaults():
    got = LoraSpec().values()
    assert (got.rank, got.alpha, got.dropout, got.use_rslora) == (32, 32.0, 0.0, False)
    assert got.target_modules == ("all-linear",)
    assert LoraSpec(rank=4, alpha=8).values().rank == 4


def test_an_adapter_config_lorarl_cannot_express_is_refused_clearly():
    with pytest.raises(AdapterConfigError, match=r"pattern '\.\*proj'"):
        merge_adapter_config(LoraSpec(adapter_path="/a"), {**PEFT, "target_modules": ".*proj"})
    with pytest.raises(AdapterConfigError, match="r='8'"):
        merge_adapter_config(LoraSpec(adapter_path="/a"), {**PEFT, "r": "8"})
    # the adapter's excludes come with its targets when the spec sets neither
    got = merge_adapter_config(LoraSpec(adapter_path="/a"), {**PEFT, "exclude_modules": ["k"]})
    assert got.exclude_modules == ("k",)


def test_the_file_is_read_where_it_is_here(tmp_path: Path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(PEFT))
    assert read_adapter_config(tmp_path)["r"] == 8
    assert values_here(LoraSpec(adapter_path=str(tmp_path))).rank == 8
    # a cluster's adapter on a volume not mounted here: the defaults, the trainer merges later
    assert values_here(LoraSpec(adapter_path=str(tmp_path / "elsewhere"))).rank == 32
    # the sidecar's expected rank: unknown there, so the trainer's update header says it
    assert rank_here(LoraSpec(adapter_path=str(tmp_path / "elsewhere"))) is None
    assert rank_here(LoraSpec(adapter_path=str(tmp_path / "elsewhere"), rank=4)) == 4
    assert (rank_here(LoraSpec(adapter_path=str(tmp_path))), rank_here(LoraSpec())) == (8, 32)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**PEFT, "peft_type": "IA3"}))
    with pytest.raises(AdapterConfigError, match="IA3 adapter, not LORA"):
        read_adapter_config(tmp_path)


def test_dropout_set_in_the_spec_wins_over_the_adapters():
    """Dropout is neither in the weights nor in the scale (and RL runs without it)."""
    got = merge_adapter_config(LoraSpec(adapter_path="/a", dropout=0.1), PEFT)
    assert (got.dropout, got.rank) == (0.1, 8)


def test_a_cluster_adapter_job_serving_the_adapter_names_its_rank():
    """On a cluster nothing that renders the engines can read the adapter, so with syncMode
    adapter the rank that sizes their LoRA slots must be in the spec; merged mode, a set rank
    and a local run (whose plan reads the adapter) need none."""
    from lorarl.api.validation import ManifestError, parse_job

    doc = yaml.safe_load((ROOT / "examples/bad/adapter-rank-unset-on-cluster.yaml").read_text())
    with pytest.raises(ManifestError, match=r"spec\.lora\.rank: required with lora\.adapterPath"):
        parse_job(doc, cluster=True)
    assert parse_job(doc).spec.lora.rank is None  # local
    ranked = copy.deepcopy(doc)
    ranked["spec"]["lora"]["rank"] = 8
    parse_job(ranked, cluster=True)
    merged = copy.deepcopy(doc)
    merged["spec"]["rollout"]["syncMode"] = "merged"
    parse_job(merged, cluster=True)
