"""What leaves a GPU trainer or scores for it: the adapter through the weight sync to a real
sidecar process (gloo, staged through host memory, bf16 on the wire) and merged there as merged
mode does it, and a reward model scoring on the GPU."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch
from transformers import LlamaForSequenceClassification

from lorarl.local.tiny import make_tokenizer, tiny_config
from lorarl.rewards.functions.reward_model import RewardModelScorer
from lorarl.sync.merge import BaseWeights, lora_scaling, merge_adapter
from lorarl.sync.names import group_lora_pairs
from lorarl.trainer.fleet.publish import WeightPublisher, for_the_wire, gather_adapter
from tests.gpu.test_trainer_gpu import ALPHA, RANK, build, rl_batch, step
from tests.integration.test_sync_transport import HOST, KEY, collect, receiver_main

SIDECAR_INDEX = 1
WIRE = torch.bfloat16  # compute_dtype on GPU under mixed precision (asserted in test_trainer_gpu)
BF16_HALF_STEP = 2.0**-8  # bf16 rounding moves a value by at most this fraction of it


def received_updates(records: list[Any]) -> dict[int, dict[str, torch.Tensor]]:
    """The sidecar's records (`receiver_main`: raw bytes per tensor) back as tensors."""
    out = {}
    for kind, version, _generation, tensors in records:
        assert kind == "update"
        out[version] = {
            name: torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype.split(".")[-1]))
            .reshape(shape)
            .clone()
            for name, (dtype, shape, raw) in tensors.items()
        }  # fmt: skip
    return out


def test_a_cuda_trainers_adapter_reaches_a_sidecar_in_bf16_and_merges_exactly(
    trainer_ctx, tiny_model_dir, device
):
    policy = build(tiny_model_dir, trainer_ctx, "bfloat16")
    batch = rl_batch(device)
    for _ in range(3):  # B moves off 0: the merge has a delta to get right
        step(policy, batch)
    master = gather_adapter(policy.model)  # what the loop publishes: full fp32, on the host
    on_device = {n: t.to(device) for n, t in master.items()}  # CUDA tensors straight in
    fp32_bytes = sum(t.numel() * t.element_size() for t in master.values())

    publisher = WeightPublisher(HOST, 0, "merged", "gloo", timeout_s=60, key=KEY, wire_dtype=WIRE)
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    sidecar = spawn.Process(
        target=receiver_main,
        args=(publisher.sender.port, SIDECAR_INDEX, (), None, results),
        daemon=True,
    )
    sidecar.start()
    try:
        assert len(publisher.sender.wait_registered(1, timeout=60)) == 1
        statuses = [
            publisher.publish(policy.model, master, version=1),
            publisher.publish(policy.model, on_device, version=2),  # staged to host by pack()
        ]
    finally:
        publisher.close()  # the sidecar reads the close and reports what it received
    try:
        reports = collect(results, 1, timeout=60)
    finally:
        sidecar.join(timeout=30)
        if sidecar.is_alive():
            sidecar.kill()
    [(how, records)] = reports[SIDECAR_INDEX]
    assert how == "closed"
    for s in statuses:
        assert s.members == 1
        assert s.bytes < 0.6 * fp32_bytes  # bf16: half the fp32 payload, plus the header
    got = received_updates(records)
    assert sorted(got) == [1, 2]
    sent = for_the_wire(master, WIRE)
    for version, tensors in got.items():  # bit-identical to the sender's, whatever its device
        assert tensors.keys() == sent.keys(), version
        for name, t in tensors.items():
            assert t.dtype == WIRE and torch.equal(t, sent[name]), (version, name)

    # The sidecar's merged mode: W = W_base + s * B @ A from pristine base copies, in fp32,
    # cast once to the engine's bf16. Against fp64 from the trainer's fp32 masters it may differ
    # by the final bf16 rounding plus what bf16 A and B cost, computed here exactly.
    scaling = lora_scaling(ALPHA, RANK)
    wire_pairs, exact_pairs = group_lora_pairs(got[1]), group_lora_pairs(master)
    assert wire_pairs.keys() == exact_pairs.keys() and len(wire_pairs) > 0
    base = BaseWeights.from_safetensors(tiny_model_dir, wire_pairs)
    merged = dict(merge_adapter(base, wire_pairs, scaling, torch.bfloat16))
    moved = 0.0
    for name, w in merged.items():
        module = name.removesuffix(".weight")
        a, b = exact_pairs[module].A.double(), exact_pairs[module].B.double()
        wa, wb = wire_pairs[module].A.double(), wire_pairs[module].B.double()
        w_base = base[name].double()
        exact = w_base + scaling * (b @ a)
        wire_error = (scaling * (wb @ wa - b @ a)).abs().max().item()
        assert w.dtype == torch.bfloat16
        torch.testing.assert_close(
            w.double(), exact, rtol=BF16_HALF_STEP, atol=wire_error + 1e-6,
            msg=lambda m, name=name: f"{name}: {m}",
        )  # fmt: skip
        moved = max(moved, ((exact - w_base).abs().max() / w_base.abs().max()).item())
    assert moved > 2 * BF16_HALF_STEP  # the delta is larger than the rounding allowed for


def test_a_reward_model_scores_on_the_gpu_as_on_the_cpu(tmp_path, device):
    """`device: auto` puts the classifier on the GPU; in bf16 it scores like fp32 on the CPU,
    and a padded batch scores each row as alone (the last real token is pooled)."""
    path = tmp_path / "reward-model"
    torch.manual_seed(0)
    config = tiny_config("llama", init_std=0.1)
    config.num_labels = 1
    LlamaForSequenceClassification(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    prompts = ["2+2=", "Name a colour: ", "x"]
    completions = ["4", "blue, or maybe green.", "yyyyyyyyyyyyyyyy"]

    scorer = RewardModelScorer(str(path), device="auto", dtype="bfloat16", batch_size=3)
    assert scorer.device.type == device.type
    assert {p.device.type for p in scorer.model.parameters()} == {device.type}
    batched = [r.score for r in scorer.score_batch(prompts, completions)]
    alone = [scorer(p, c, None, {}).score for p, c in zip(prompts, completions, strict=True)]
    reference = RewardModelScorer(str(path), device="cpu", dtype="float32")
    exact = [r.score for r in reference.score_batch(prompts, completions)]

    assert len(set(exact)) == len(exact)  # rows that differ: a mixed-up row would show
    assert batched == pytest.approx(alone, abs=0.05)
    assert batched == pytest.approx(exact, rel=0.05, abs=0.05)
