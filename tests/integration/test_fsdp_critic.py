"""The PPO critic (second LoRA adapter + value head on the actor's base) under FSDP2 on two real
gloo ranks, checked against the same computation in one plain process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from harness.workloads.tiny_models import make_tiny_model
from lorarl.local.ports import free_port
from lorarl.trainer.model.critic import critic_parameters, sequence_values
from lorarl.trainer.model.loading import load_base_model
from lorarl.trainer.model.logprobs import sequence_logprobs
from tests.integration import fsdp_critic_worker as W

pytestmark = pytest.mark.slow  # one torchrun launch of two ranks, ~20-40 s on 2 shared cores

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fsdp_critic")
    model = make_tiny_model(root / "model", arch="llama")
    out = root / "out"
    out.mkdir()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(W.WORLD),
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(REPO / "tests/integration/fsdp_critic_worker.py"),
        "--model", str(model), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"torchrun failed (rc {proc.returncode}):\n{tail}"
    return {"model": model, "out": out, "results": torch.load(out / "results.pt")}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_values_and_value_gradients_equal_the_unsharded_ones(run):
    model = W.build(str(run["model"]), W.INIT_SEED)
    results = run["results"]
    for rank, got in enumerate(results["per_rank"]):
        ids, attn, resp = W.make_batch(0, rank)
        with torch.no_grad():
            want = sequence_values(model, ids, attn, resp, micro_batch_size=W.MICRO_BATCH_SIZE)
        assert want[resp.bool()].abs().min() > 0  # non-trivial values
        assert _max_diff(got["values"], want) < 1e-5, rank
    for rank in range(W.WORLD):  # FSDP2 averages the ranks' gradients
        (W.value_loss(model, 0, rank) / W.WORLD).backward()
    got = results["critic_grads"]
    names = [n for n, _ in critic_parameters(model)]
    assert list(got) == names and any("value_head" in n for n in names)
    for name, p in critic_parameters(model):
        assert p.grad.abs().sum() > 0, name
        assert _max_diff(got[name], p.grad) < 1e-5, name
    assert results["actor_grads_none"]


def test_actor_logprobs_are_unchanged_by_the_critic(run):
    actor_only = W.build(str(run["model"]), W.INIT_SEED, critic=False)
    for rank, got in enumerate(run["results"]["per_rank"]):
        ids, attn, resp = W.make_batch(0, rank)
        with torch.no_grad():
            want, _ = sequence_logprobs(
                actor_only, ids, attn, resp, micro_batch_size=W.MICRO_BATCH_SIZE
            )
        assert _max_diff(got["logprobs"], want) < 1e-5, rank


def test_a_two_rank_checkpoint_resumes_actor_critic_and_both_optimizers_exactly(run):
    results = run["results"]
    assert results["loaded"] == {"step": W.TRAIN_STEPS, "state": {"pos": 7}}
    a, b = results["uninterrupted"], results["resumed"]
    assert a.keys() == b.keys()
    kinds = {k.split("/", 1)[0] for k in a}
    assert kinds == {"actor", "critic", "actor_opt", "critic_opt"}
    assert any("value_head" in k for k in a if k.startswith("critic_opt/"))
    assert any("exp_avg_sq" in k for k in a if k.startswith("critic_opt/"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # ... and the step after the checkpoint moved both adapters, the head and both optimizers.
    at_save = results["at_save"]
    for part in ("actor/", "critic/", "actor_opt/", "critic_opt/", "critic/value_head"):
        assert any(not torch.equal(a[k], at_save[k]) for k in a if k.startswith(part)), part


def test_both_adapters_train_under_fsdp_after_reference_passes(run):
    """The reference pass (every adapter disabled) leaves both adapters trainable when sharded."""
    initial, trained = run["results"]["initial"], run["results"]["at_save"]
    assert any(k.startswith("actor/") for k in initial) and any("lora_B" in k for k in initial)
    for k, v in initial.items():  # every LoRA A/B of both adapters and the head moved
        assert not torch.equal(v, trained[k]), k
    ckpt = run["out"] / "ckpt" / f"step-{W.TRAIN_STEPS:06d}"
    assert (ckpt / "critic" / "value_head.safetensors").is_file()
    assert (ckpt / "critic_optimizer.pt").is_file()


def test_the_exported_critic_reproduces_the_trained_values(run):
    """Gathered from two shards, written by rank 0, loaded by plain PEFT."""
    critic_dir = run["out"] / "critic"
    critic = PeftModel.from_pretrained(load_base_model(run["model"]), str(critic_dir))
    head = torch.nn.Linear(critic.config.hidden_size, 1)
    head.load_state_dict(load_file(str(critic_dir / "value_head.safetensors")))
    ids, attn, resp = W.make_batch(0, 0)
    with torch.no_grad():
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = critic(
            input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True
        )
        v = head(out.hidden_states[-1]).squeeze(-1)
    want = torch.where(resp[:, 1:].bool(), v[:, :-1], 0.0)
    got = run["results"]["trained_values"][:, 1:]
    assert _max_diff(got, want) < 1e-5
