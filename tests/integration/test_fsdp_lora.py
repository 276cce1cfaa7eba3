"""FSDP2 + PEFT LoRA across two real gloo ranks (torchrun): train, checkpoint, resume, export.

The distributed run is replayed in one plain process (same init, same batches, gradients averaged
over the two ranks) so sharding, gradient accumulation and clipping are checked against an
unsharded ground truth rather than just "something changed".
"""

from __future__ import annotations

import json
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
from lorarl.trainer.model.loading import apply_lora, load_base_model, lora_state_dict
from lorarl.trainer.model.logprobs import sequence_logprobs
from tests.integration import fsdp_worker as W

pytestmark = pytest.mark.slow  # two torchrun launches, ~30-45 s on 2 shared cores

REPO = Path(__file__).resolve().parents[2]
WORLD = 2


def _torchrun(mode: str, model: Path, ckpt: Path, out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(WORLD),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(REPO / "tests/integration/fsdp_worker.py"),
        mode,
        "--model",
        str(model),
        "--ckpt",
        str(ckpt),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, f"torchrun {mode} failed (rc {proc.returncode}):\n{tail}"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    model = make_tiny_model(root / "model", arch="llama")
    paths = {"model": model, "ckpt": root / "ckpt", "out": root / "out"}
    paths["out"].mkdir()
    _torchrun("train", model, paths["ckpt"], paths["out"])
    _torchrun("resume", model, paths["ckpt"], paths["out"])
    return paths


def _results(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}_rank{r}.json").read_text()) for r in range(WORLD)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _replay_single_process(model_dir: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same two optimizer steps without FSDP: each rank's loss averaged, as FSDP2 does."""
    torch.manual_seed(W.INIT_SEED)
    model = apply_lora(load_base_model(model_dir), W.LORA)
    opt = W.make_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for step in range(W.STEPS_BEFORE_SAVE):
        for rank in range(WORLD):
            for micro in range(W.MICRO_BATCHES):
                (W.micro_loss(model, step, rank, micro) / WORLD).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, W.MAX_GRAD_NORM)))
        opt.step()
        opt.zero_grad()
    return lora_state_dict(model), norms


def test_training_changes_only_lora_and_matches_unsharded_replay(run):
    results = _results(run["out"], "train")
    for r in results:
        assert r["base_unchanged"], f"rank {r['rank']}: base weights moved"
        assert r["lora_changed"] and all(r["lora_changed"].values()), r["lora_changed"]
    trained = load_file(str(run["out"] / "trained.safetensors"))
    expected, norms = _replay_single_process(run["model"])
    assert _max_diff(trained, expected) < 1e-5
    for r in results:  # clip saw the global norm (not a shard's) on every rank
        assert r["norms"] == pytest.approx(norms, rel=1e-4)
    assert all(n > W.MAX_GRAD_NORM for n in norms), "clipping was not exercised"


def test_checkpoint_layout_and_resume_is_exact(run):
    ckpt = run["ckpt"] / f"step-{W.STEPS_BEFORE_SAVE:06d}"
    for name in (
        "adapter/adapter_model.safetensors",
        "adapter/adapter_config.json",
        "optimizer.pt",
        "state.json",
        "rng.pt",
        "COMPLETE",
    ):
        assert (ckpt / name).is_file(), name
    trained = load_file(str(run["out"] / "trained.safetensors"))
    restored = load_file(str(run["out"] / "restored.safetensors"))
    assert _max_diff(trained, restored) == 0.0
    resumed = _results(run["out"], "resume")
    for before, after in zip(_results(run["out"], "train"), resumed, strict=True):
        assert after["loaded_step"] == W.STEPS_BEFORE_SAVE
        assert after["trainer_state"] == {"data_position": 123}
        assert after["rand_after_ckpt"] == before["rand_after_ckpt"]  # per-rank RNG restored
    assert resumed[0]["rand_after_ckpt"] != resumed[1]["rand_after_ckpt"]
    # The step after resume equals the uninterrupted one only if Adam's moments came back too.
    final_train = load_file(str(run["out"] / "train_final.safetensors"))
    final_resume = load_file(str(run["out"] / "resume_final.safetensors"))
    assert _max_diff(final_train, final_resume) == 0.0
    assert _max_diff(final_train, trained) > 0.0


@pytest.mark.parametrize("adapter", ["exported", "checkpoint"])
def test_saved_adapter_loads_in_plain_peft_with_same_logits(run, adapter):
    folder = (
        run["out"] / "exported"
        if adapter == "exported"
        else run["ckpt"] / f"step-{W.STEPS_BEFORE_SAVE:06d}" / "adapter"
    )
    model = PeftModel.from_pretrained(load_base_model(run["model"]), str(folder))
    ids, attn = W.probe_batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    trainer_logits = torch.load(run["out"] / "probe_logits.pt")
    assert (logits - trainer_logits).abs().max().item() <= 1e-5
    with torch.no_grad(), model.disable_adapter():  # and the adapter is not a no-op
        base_logits = model(input_ids=ids, attention_mask=attn).logits
    assert (base_logits - trainer_logits).abs().max().item() > 1e-4


def test_initial_adapter_reference_under_fsdp_is_the_initial_adapter(run):
    """`kl.reference: initialAdapter` on 2 sharded ranks scores with the adapter training started
    from (loaded here by plain PEFT, unsharded), not the base model nor the moved policy, and
    the policy's own tensors are back afterwards."""
    got = torch.load(run["out"] / "initial_adapter_reference.pt")
    ids, attn, resp = W.reference_batch()
    initial = PeftModel.from_pretrained(load_base_model(run["model"]), str(run["out"] / "exported"))
    with torch.no_grad():
        want, _ = sequence_logprobs(initial, ids, attn, resp, micro_batch_size=2)
    assert (got["reference"] - want).abs().max().item() <= 1e-5
    assert (got["reference"] - got["base"]).abs().max().item() > 1e-3
    assert (got["reference"] - got["policy"]).abs().max().item() > 1e-4
    assert torch.equal(got["policy_after"], got["policy"])
