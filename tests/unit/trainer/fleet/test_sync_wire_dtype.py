"""What the adapter travels in: the trainer's compute dtype (bf16 under FSDP2 mixed precision on
GPU), half the bytes of PEFT's fp32 master copy; fp32 wherever the trainer computes in fp32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig

from lorarl.sync.merge import merge_weight
from lorarl.trainer.fleet.publish import WeightPublisher, for_the_wire
from lorarl.trainer.model.parallel import DistContext, compute_dtype


def _ctx(device: str, backend: str | None) -> DistContext:
    return DistContext(rank=0, world_size=2 if backend else 1, local_rank=0,
                       device=torch.device(device), backend=backend)  # fmt: skip


@pytest.mark.parametrize(
    ("device", "backend", "mixed", "want"),
    [
        ("cuda", "nccl", True, torch.bfloat16),  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16)
        ("cuda", "nccl", False, None),
        ("cuda", None, True, None),  # one plain process: shard_model applies no policy
        ("cpu", "gloo", True, None),  # CPU bf16 is slow: no policy on CPU
        ("cpu", None, True, None),
    ],
)
def test_the_wire_dtype_is_the_dtype_the_trainer_computes_in(device, backend, mixed, want):
    assert compute_dtype(_ctx(device, backend), mixed) == want


def test_floating_tensors_are_cast_and_the_callers_dict_is_untouched() -> None:
    tensors = {"a": torch.randn(4, 8), "step": torch.tensor([3])}
    out = for_the_wire(tensors, torch.bfloat16)
    assert out["a"].dtype == torch.bfloat16 and out["step"].dtype == torch.int64
    assert tensors["a"].dtype == torch.float32
    assert for_the_wire(tensors, None) is tensors


def test_the_publisher_sends_the_cast_tensors_and_half_the_bytes(monkeypatch) -> None:
    sent: list[dict[str, torch.Tensor]] = []

    class Sender:
        def send(self, tensors, header, members):
            sent.append(tensors)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            return SimpleNamespace(ok=True, acks=[1], stats=SimpleNamespace(bytes=nbytes))

    monkeypatch.setattr("lorarl.trainer.fleet.publish.SyncSender", lambda *a, **k: Sender())
    config = LoraConfig(r=2, lora_alpha=4, use_rslora=False)
    model = SimpleNamespace(peft_config={"default": config})
    name = "base_model.model.layers.0.q_proj.lora_{}.weight"
    tensors = {name.format("A"): torch.randn(2, 8), name.format("B"): torch.randn(8, 2)}
    fp32 = WeightPublisher("h", 1, "merged", "nccl", key="k").publish(model, tensors, 1)
    bf16 = WeightPublisher("h", 1, "merged", "nccl", key="k", wire_dtype=torch.bfloat16)
    half = bf16.publish(model, tensors, 2)
    assert [t.dtype for t in sent[1].values()] == [torch.bfloat16] * 2
    assert half.bytes * 2 == fp32.bytes
    assert tensors[name.format("A")].dtype == torch.float32  # the checkpoint copy stays fp32


def test_a_bf16_adapter_merges_into_bf16_weights_within_their_own_rounding() -> None:
    """The engine keeps bf16 weights: a bf16 A/B leaves the merged result within one bf16 step
    of the exact one, the rounding the engine applies to it anyway."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(256, 128, generator=g) * 0.02).to(torch.bfloat16)
    A, B = torch.randn(32, 128, generator=g) * 0.01, torch.randn(256, 32, generator=g) * 0.01
    exact = merge_weight(base, A, B, 1.0, torch.float32)
    wire = merge_weight(base, A.to(torch.bfloat16), B.to(torch.bfloat16), 1.0, torch.bfloat16)
    engine = exact.to(torch.bfloat16)
    engine_error = (engine.float() - exact).abs().max()  # half a bf16 step, at most
    assert (wire.float() - exact).abs().max() <= 2 * engine_error
    assert (wire != engine).float().mean() < 0.05  # most weights round to the same bf16 value
