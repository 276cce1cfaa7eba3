"""Merged-mode math against hand-computed values and against PEFT's own merge."""

from __future__ import annotations

import inspect

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import make_tiny_model
from lorarl.sync.errors import UpdateValidationError
from lorarl.sync.merge import BaseWeights, lora_scaling, merge_adapter, merge_weight
from lorarl.sync.names import LoraPair, group_lora_pairs


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama")


def test_merge_weight_hand_computed():
    w = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])  # [out=2, in=3]
    A = torch.tensor([[1.0, 2.0, 3.0]])  # [r=1, in=3]
    B = torch.tensor([[1.0], [2.0]])  # [out=2, r=1]
    # B@A = [[1,2,3],[2,4,6]]; W + 0.5·B@A:
    expected = torch.tensor([[1.5, 1.0, 1.5], [1.0, 3.0, 3.0]])
    assert torch.equal(merge_weight(w, A, B, 0.5), expected)
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))  # base untouched


def test_scaling_plain_and_rslora():
    assert lora_scaling(16, 4) == 4.0
    assert lora_scaling(16, 4, use_rslora=True) == 8.0  # 16 / sqrt(4)
    assert lora_scaling(8, 64, use_rslora=True) == 1.0
    with pytest.raises(ValueError, match="rank"):
        lora_scaling(16, 0)
    with pytest.raises(ValueError, match="alpha"):
        lora_scaling(0, 8)


def test_merge_computes_in_fp32_and_casts_once():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 64, generator=g).bfloat16()
    A = (torch.randn(8, 64, generator=g) * 0.1).bfloat16()
    B = (torch.randn(64, 8, generator=g) * 0.1).bfloat16()
    merged = merge_weight(w, A, B, 0.5)
    assert merged.dtype == torch.bfloat16
    assert torch.equal(merged, (w.float() + 0.5 * (B.float() @ A.float())).bfloat16())
    # Arithmetic in bf16 rounds twice and lands elsewhere: the fp32 path is not a no-op.
    assert not torch.equal(merged, w + 0.5 * (B @ A))
    assert merge_weight(w, A, B, 0.5, out_dtype=torch.float16).dtype == torch.float16
    exact = merge_weight(w, A, B, 0.5, out_dtype=torch.float32)
    assert torch.equal(exact, w.float() + 0.5 * (B.float() @ A.float()))


def test_shape_mismatch_is_explained():
    w = torch.zeros(4, 3)
    with pytest.raises(UpdateValidationError, match=r"needs A \[r, 3\] and B \[4, r\]"):
        merge_weight(w, torch.zeros(2, 4), torch.zeros(4, 2), 1.0)


def test_successive_merges_never_drift():
    g = torch.Generator().manual_seed(0)

    def ints(*shape):  # small integers: every fp32 product and sum below is exact
        return torch.randint(-3, 4, shape, generator=g).float()

    base = {"m.q_proj.weight": ints(6, 5), "m.o_proj.weight": ints(5, 6)}
    pristine = {k: v.clone() for k, v in base.items()}
    s = 0.5
    adapters = [
        {
            "m.q_proj": LoraPair(A=ints(2, 5), B=ints(6, 2)),
            "m.o_proj": LoraPair(A=ints(2, 6), B=ints(5, 2)),
        }
        for _ in range(5)
    ]
    first = None
    for pairs in adapters:
        merged = dict(merge_adapter(base, pairs, s, torch.float32))
        for module, pair in pairs.items():
            name = f"{module}.weight"
            want = pristine[name] + s * (pair.B @ pair.A)
            assert torch.equal(merged[name], want)
        for name in base:
            assert torch.equal(base[name], pristine[name])
        first = first or merged
    again = dict(merge_adapter(base, adapters[0], s, torch.float32))
    assert all(torch.equal(again[k], first[k]) for k in first)


def test_merge_adapter_is_lazy_and_passes_siblings_through():
    base = {"l.q_proj.weight": torch.ones(2, 2), "l.k_proj.weight": torch.full((2, 2), 7.0)}
    pairs = {"l.q_proj": LoraPair(A=torch.eye(2), B=torch.eye(2))}
    gen = merge_adapter(base, pairs, 2.0, torch.bfloat16, passthrough=["l.k_proj.weight"])
    assert inspect.isgenerator(gen)
    out = list(gen)
    assert [n for n, _ in out] == ["l.q_proj.weight", "l.k_proj.weight"]
    assert out[0][1].tolist() == [[3.0, 1.0], [1.0, 3.0]]
    assert out[1][1].dtype == torch.bfloat16 and out[1][1].tolist() == [[7.0, 7.0], [7.0, 7.0]]
    out[1][1].zero_()
    assert base["l.k_proj.weight"][0, 0] == 7.0  # passthrough is a copy
    with pytest.raises(UpdateValidationError, match=r"l\.v_proj\.weight"):
        list(merge_adapter(base, {"l.v_proj": pairs["l.q_proj"]}, 1.0))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_matches_peft_merge_and_unload(tiny_dir, use_rslora):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", use_rslora=use_rslora,
        init_lora_weights=False,  # random B, so the delta is not zero
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    pairs = group_lora_pairs(
        {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    )
    base = BaseWeights.from_safetensors(tiny_dir, pairs)
    scaling = lora_scaling(8, 4, use_rslora)
    ours = dict(merge_adapter(base, pairs, scaling, torch.float32))
    reference = peft_model.merge_and_unload().state_dict()
    assert set(ours) == {f"{m}.weight" for m in pairs}
    for name, tensor in ours.items():
        delta = (tensor - base[name]).abs().max()
        assert delta > 1e-4  # the adapter really changed the weight
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6)


def test_base_weights_from_sharded_checkpoint(tiny_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    modules = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    sharded = BaseWeights.from_safetensors(tmp_path, modules)
    single = BaseWeights.from_safetensors(tiny_dir, modules)
    assert list(sharded) == [f"{m}.weight" for m in modules]
    for name in sharded:
        assert torch.equal(sharded[name], single[name])
    assert sharded.shapes() == {
        "model.layers.0.self_attn.q_proj": (128, 128),
        "model.layers.1.mlp.down_proj": (128, 256),
        "lm_head": (128, 128),
    }


def test_base_weights_missing_module_is_named(tiny_dir, tmp_path):
    with pytest.raises(UpdateValidationError, match=r"model\.layers\.9\.self_attn\.q_proj\.weight"):
        BaseWeights.from_safetensors(tiny_dir, ["model.layers.9.self_attn.q_proj"])
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        BaseWeights.from_safetensors(tmp_path, ["lm_head"])
