"""bf16 LoRA compute on CPU (`trainer/model/precision.py`): when it applies, and that it changes
the arithmetic's precision, not what is computed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

from harness.workloads.tiny_models import make_tiny_model
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_parameters
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.model.precision import (
    cpu_lora_autocast_dtype,
    lora_compute,
    set_lora_autocast,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def lora_model(model_dir, dtype: str):
    torch.manual_seed(0)
    model = apply_lora(load_base_model(model_dir, dtype), LoraSettings(rank=8, alpha=16))
    with torch.no_grad():  # a trained-looking adapter: B = 0 would hide the LoRA path
        for _, p in lora_parameters(model):
            p.normal_(0, 0.05)
    return model


def batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (4, 20), generator=g)
    attention = torch.ones_like(ids)
    response = torch.zeros_like(ids)
    response[:, 12:] = 1
    return ids, attention, response


@pytest.mark.parametrize(
    ("dtype", "device", "mixed", "expected"),
    [
        ("bfloat16", CPU, True, torch.bfloat16),
        ("float16", CPU, True, torch.float16),
        ("float32", CPU, True, None),  # an fp32 model computes exactly as before
        ("bfloat16", CPU, False, None),  # trainer.fsdp.mixedPrecision off
        ("bfloat16", CUDA, True, None),  # FSDP2's mixed precision does it on GPU
    ],
)
def test_when_the_lora_path_runs_in_the_base_dtype(model_dir, dtype, device, mixed, expected):
    assert cpu_lora_autocast_dtype(lora_model(model_dir, dtype), device, mixed) == expected


def test_an_adapter_already_in_bf16_is_left_alone(model_dir):
    model = lora_model(model_dir, "bfloat16")
    for _, p in lora_parameters(model):
        p.data = p.data.to(torch.bfloat16)
    assert cpu_lora_autocast_dtype(model, CPU, True) is None


def test_lora_matmuls_run_in_bf16_and_gradients_stay_fp32(model_dir):
    model = lora_model(model_dir, "bfloat16")
    set_lora_autocast(model, torch.bfloat16)
    seen: list[torch.dtype] = []
    layer = next(m for m in model.modules() if isinstance(m, LoraLayer))
    layer.lora_A["default"].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids, attention, response = batch(model.config.vocab_size)
    lp, _ = sequence_logprobs(model, ids, attention, response, micro_batch_size=4)
    assert seen == [torch.bfloat16]  # without autocast PEFT would have cast up to fp32
    assert lp.dtype == torch.float32
    (-lp.sum()).backward()
    grads = [p.grad for _, p in lora_parameters(model)]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(p.dtype == torch.float32 for _, p in lora_parameters(model))


def test_bf16_lora_compute_scores_and_steers_like_fp32_lora_compute(model_dir):
    """Same model, same batch: logprobs within bf16 rounding, gradients pointing the same way."""
    results = {}
    for dtype in (None, torch.bfloat16):
        model = lora_model(model_dir, "bfloat16")
        set_lora_autocast(model, dtype)
        ids, attention, response = batch(model.config.vocab_size)
        lp, _ = sequence_logprobs(model, ids, attention, response, micro_batch_size=2)
        (-lp.sum()).backward()
        grad = torch.cat([p.grad.flatten() for _, p in lora_parameters(model)])
        results[dtype] = (lp.detach(), grad)
    (lp32, g32), (lp16, g16) = results[None], results[torch.bfloat16]
    mask = response.bool()
    assert not torch.equal(lp32, lp16)  # it did change the arithmetic
    assert (lp32 - lp16)[mask].abs().max() < 0.05
    assert F.cosine_similarity(g32, g16, dim=0) > 0.99
    assert g16.norm() / g32.norm() == pytest.approx(1.0, abs=0.02)


def test_the_context_restores_pefts_input_casting(model_dir):
    model = lora_model(model_dir, "bfloat16")
    set_lora_autocast(model, torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    with lora_compute(model):
        assert not any(m.cast_input_dtype_enabled for m in layers)
    assert all(m.cast_input_dtype_enabled for m in layers)  # e.g. for PPO's critic pass
