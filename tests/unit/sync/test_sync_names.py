"""PEFT -> Hugging Face name mapping, checked against names real PEFT models produce."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import make_tiny_model
from lorarl.sync.errors import LoraNameError, MissingLoraPairError, UnsupportedLoraError
from lorarl.sync.names import (
    base_weight_name,
    fused_groups,
    group_lora_pairs,
    modules_to_send,
    parse_lora_name,
)

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    arch = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
    return arch, path


def _peft(path, **lora):
    model = AutoModelForCausalLM.from_pretrained(path)
    return model, get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **lora))


def _expected_modules(layers: int = 2) -> set[str]:
    out = set()
    for i in range(layers):
        for leaf in LINEAR_LEAVES:
            parent = "mlp" if leaf in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out.add(f"model.layers.{i}.{parent}.{leaf}")
    return out


@pytest.mark.parametrize(
    ("name", "module", "part", "adapter"),
    [
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
            "model.layers.0.self_attn.q_proj",
            "A",
            "default",
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "model.layers.0.self_attn.q_proj",
            "A",
            None,
        ),
        (
            "base_model.model.model.layers.3.mlp.down_proj.lora_B.policy.weight",
            "model.layers.3.mlp.down_proj",
            "B",
            "policy",
        ),
        ("base_model.model.lm_head.lora_B.default.weight", "lm_head", "B", "default"),
    ],
)
def test_parse_lora_name(name, module, part, adapter):
    parsed = parse_lora_name(name)
    assert (parsed.module, parsed.part, parsed.adapter) == (module, part, adapter)
    assert parsed.base_weight_name == f"{module}.weight"
    assert parsed.peft_name == f"base_model.model.{module}.lora_{part}.weight"


def test_base_weight_name_strips_peft_wrappers():
    assert (
        base_weight_name("base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight")
        == "model.layers.1.self_attn.v_proj.weight"
    )
    assert base_weight_name("base_model.model.lm_head.lora_A.default.weight") == "lm_head.weight"


@pytest.mark.parametrize(
    "name",
    [
        "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.default.weight",
        "base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight",
        "model.layers.0.self_attn.qkv_proj.weight",
    ],
)
def test_fused_engine_names_are_refused(name):
    with pytest.raises(LoraNameError, match="fused"):
        base_weight_name(name)


def test_fused_names_allowed_for_fused_checkpoints():
    # Phi-3 stores qkv_proj in its Hugging Face checkpoint, so the caller may opt in.
    parsed = parse_lora_name(
        "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", allow_fused=True
    )
    assert parsed.module == "model.layers.0.self_attn.qkv_proj"


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("base_model.model.model.embed_tokens.lora_embedding_A.default", UnsupportedLoraError),
        ("base_model.model.model.embed_tokens.lora_embedding_B", UnsupportedLoraError),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.bias",
            UnsupportedLoraError,
        ),
        (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight",
            UnsupportedLoraError,
        ),
        ("base_model.model.model.layers.0.self_attn.q_proj.weight", LoraNameError),
    ],
)
def test_unsupported_and_non_lora_names(name, error):
    with pytest.raises(error, match=r"q_proj|embed_tokens"):
        parse_lora_name(name)


def test_all_linear_peft_state_dict_maps_to_hf_names(tiny):
    _, path = tiny
    _, peft_model = _peft(path, target_modules="all-linear")
    hf_names = set(AutoModelForCausalLM.from_pretrained(path).state_dict())
    saved = get_peft_model_state_dict(peft_model)  # adapter_model.safetensors naming
    raw = peft_model.state_dict()  # live naming, with `.default` and base_layer entries
    for sd in (saved, raw):
        pairs = group_lora_pairs(sd)
        assert set(pairs) == _expected_modules()
        for module, pair in pairs.items():
            assert f"{module}.weight" in hf_names  # a real Hugging Face weight
            assert pair.A.shape[0] == 4 and pair.B.shape[1] == 4
    # The grouped tensors are the very objects PEFT holds, not copies or transposes.
    q = "model.layers.0.self_attn.q_proj"
    assert torch.equal(
        group_lora_pairs(raw)[q].A,
        peft_model.state_dict()[f"base_model.model.{q}.lora_A.default.weight"],
    )


def test_lm_head_target_maps_to_lm_head_weight(tiny):
    _, path = tiny
    _, peft_model = _peft(path, target_modules=["q_proj", "lm_head"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT also saves lm_head's base weight; we ignore it
        sd = get_peft_model_state_dict(peft_model)
    pairs = group_lora_pairs(sd)
    assert set(pairs) == {
        "lm_head",
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
    }
    assert pairs["lm_head"].B.shape == (128, 4)


def test_embedding_lora_in_state_dict_is_rejected(tiny):
    _, path = tiny
    _, peft_model = _peft(path, target_modules=["q_proj", "embed_tokens"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = get_peft_model_state_dict(peft_model)
    with pytest.raises(UnsupportedLoraError, match="embed_tokens"):
        group_lora_pairs(sd)


def test_missing_half_is_named():
    sd = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": 1,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": 2,
        "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": 3,
    }
    with pytest.raises(MissingLoraPairError, match=r"model\.layers\.0\.self_attn\.k_proj.*lora_B"):
        group_lora_pairs(sd)


def test_mixed_adapters_need_a_choice():
    sd = {
        "base_model.model.m.q_proj.lora_A.one.weight": 1,
        "base_model.model.m.q_proj.lora_B.one.weight": 2,
        "base_model.model.m.q_proj.lora_A.two.weight": 3,
        "base_model.model.m.q_proj.lora_B.two.weight": 4,
    }
    with pytest.raises(LoraNameError, match="adapter"):
        group_lora_pairs(sd)
    pairs = group_lora_pairs(sd, adapter="two")
    assert (pairs["m.q_proj"].A, pairs["m.q_proj"].B) == (3, 4)


def test_fused_groups_cover_untargeted_siblings():
    targets = [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.1.self_attn.v_proj",
        "model.layers.1.self_attn.k_proj",
        "lm_head",
    ]
    assert fused_groups(targets) == [
        (
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj",
        ),
        ("model.layers.0.self_attn.o_proj",),
        ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"),
        (
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.v_proj",
        ),
        ("lm_head",),
    ]


def test_fused_groups_respect_known_modules_and_all_linear(tiny):
    _, path = tiny
    _, peft_model = _peft(path, target_modules="all-linear")
    targets = list(group_lora_pairs(get_peft_model_state_dict(peft_model)))
    groups = fused_groups(targets)
    assert sorted(m for g in groups for m in g) == sorted(targets)  # a partition, nothing added
    assert sum(len(g) == 3 for g in groups) == 2 and sum(len(g) == 2 for g in groups) == 2
    # An architecture without k_proj: the sibling is dropped rather than invented.
    known = {"x.q_proj", "x.v_proj"}
    assert modules_to_send(["x.q_proj"], known_modules=known) == ["x.q_proj", "x.v_proj"]
    with pytest.raises(LoraNameError):
        fused_groups(["model.layers.0.self_attn.qkv_proj"])
