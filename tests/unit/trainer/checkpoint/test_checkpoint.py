"""CheckpointManager and export_adapter in one plain process (no process group)."""

from __future__ import annotations

import json
import logging
import random
import shutil

import pytest
import torch
from peft import PeftModel

from harness.workloads.tiny_models import make_tiny_model
from lorarl.trainer.checkpoint.manager import (
    COMPLETE,
    CheckpointError,
    CheckpointManager,
    export_adapter,
)
from lorarl.trainer.model.loading import (
    LoraSettings,
    apply_lora,
    load_base_model,
    lora_parameters,
    lora_state_dict,
)

SETTINGS = LoraSettings(rank=4, alpha=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama")


def _trained(model_dir, seed: int = 0, steps: int = 2):
    """A LoRA model and AdamW that have taken real steps (non-zero B, non-empty Adam state)."""
    torch.manual_seed(seed)
    model = apply_lora(load_base_model(model_dir), SETTINGS)
    opt = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-2)
    ids = torch.randint(4, 100, (2, 8), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        model(input_ids=ids).logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh(model_dir, seed: int = 99):
    torch.manual_seed(seed)
    model = apply_lora(load_base_model(model_dir), SETTINGS)
    return model, torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-2)


def test_save_layout_and_contents(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=3)
    path = mgr.save(10, model, opt, {"data_position": 42, "metrics": {"reward": 0.5}})
    assert path == tmp_path / "step-000010"
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["adapter", "optimizer.pt", "state.json", "rng.pt", COMPLETE]
    )
    assert sorted(p.name for p in (path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 10 and state["world_size"] == 1
    assert state["trainer_state"] == {"data_position": 42, "metrics": {"reward": 0.5}}
    config = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["inference_mode"]) == (4, 8, True)
    assert config["target_modules"] == sorted(config["target_modules"])
    assert [p.name for p in tmp_path.iterdir()] == ["step-000010"]  # no temp dir left behind
    # The checkpoint's adapter is a plain PEFT adapter reproducing the trained model.
    reloaded = PeftModel.from_pretrained(load_base_model(model_dir), str(path / "adapter"))
    ids = torch.arange(4, 20).unsqueeze(0)
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, model(ids).logits, atol=1e-6)


def test_latest_and_prune_keep_last(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.latest() is None
    for step in (1, 2, 3):
        mgr.save(step, model, opt, {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]
    latest = mgr.latest()
    assert latest is not None and latest.step == 3 and latest.path == tmp_path / "step-000003"
    assert mgr.latest_shared() == latest  # no process group: rank 0 is this process


def test_latest_skips_incomplete_and_corrupted(model_dir, tmp_path, caplog):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=5)
    good = mgr.save(3, model, opt, {})
    no_marker = tmp_path / "step-000004"
    shutil.copytree(good, no_marker)
    (no_marker / COMPLETE).unlink()
    truncated = tmp_path / "step-000005"
    shutil.copytree(good, truncated)
    opt_file = truncated / "optimizer.pt"
    opt_file.write_bytes(opt_file.read_bytes()[:100])
    flipped = tmp_path / "step-000006"
    shutil.copytree(good, flipped)
    weights = flipped / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, different content
    weights.write_bytes(bytes(data))
    garbage_state = tmp_path / "step-000007"
    shutil.copytree(good, garbage_state)
    (garbage_state / "state.json").write_text("{not json")

    with caplog.at_level(logging.WARNING, logger="lorarl.trainer.checkpoint.manager"):
        latest = mgr.latest()
    assert latest is not None and latest.step == 3
    warned = caplog.text
    for broken in (no_marker, truncated, flipped, garbage_state):
        assert str(broken) in warned
    assert "no COMPLETE marker" in warned and "checksum mismatch" in warned
    assert "optimizer.pt has 100 bytes" in warned
    with pytest.raises(CheckpointError, match="step-000006"):
        mgr.load(flipped, *_fresh(model_dir))


def test_prune_leaves_broken_dirs_and_removes_stale_temp(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=1)
    (tmp_path / "step-000001").mkdir()  # broken: kept for inspection
    (tmp_path / ".tmp-step-000009-deadbeef").mkdir()  # a crashed save
    mgr.save(2, model, opt, {})
    mgr.save(3, model, opt, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001", "step-000003"]


def test_resave_same_step_replaces(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(5, model, opt, {"attempt": 1})
    path = mgr.save(5, model, opt, {"attempt": 2})
    assert json.loads((path / "state.json").read_text())["trainer_state"] == {"attempt": 2}
    assert mgr.verify(path) is None
    assert [p.name for p in tmp_path.iterdir()] == ["step-000005"]


def test_load_restores_adapter_optimizer_and_rng(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    torch.manual_seed(123)
    random.seed(7)
    mgr.save(7, model, opt, {"data_position": 9})
    after_save = (torch.rand(4), random.random())

    fresh, fresh_opt = _fresh(model_dir)
    torch.manual_seed(0)
    random.seed(0)
    loaded = mgr.load(mgr.latest(), fresh, fresh_opt)
    assert (loaded.step, loaded.trainer_state) == (7, {"data_position": 9})
    assert torch.equal(torch.rand(4), after_save[0]) and random.random() == after_save[1]

    want, got = lora_state_dict(model), lora_state_dict(fresh)
    assert all(torch.equal(want[k], got[k]) for k in want)
    s_want, s_got = opt.state_dict(), fresh_opt.state_dict()
    assert s_want["state"].keys() == s_got["state"].keys() and s_want["state"]
    for idx, st in s_want["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[key], s_got["state"][idx][key]), (idx, key)
    assert any(st["exp_avg"].abs().sum() > 0 for st in s_got["state"].values())


def test_save_rejects_bad_input(model_dir, tmp_path):
    model, opt = _trained(model_dir, steps=0)
    mgr = CheckpointManager(tmp_path)
    with pytest.raises(ValueError, match="trainer_state must be JSON"):
        mgr.save(1, model, opt, {"bad": object()})
    with pytest.raises(ValueError, match="step must be >= 0"):
        mgr.save(-1, model, opt, {})
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)
    assert not any(tmp_path.iterdir())


def test_export_adapter_is_atomic_replace_and_loadable(model_dir, tmp_path):
    out = tmp_path / "final"
    model_a, _ = _trained(model_dir, seed=1)
    model_b, _ = _trained(model_dir, seed=2)
    export_adapter(model_a, out)
    export_adapter(model_b, out)  # replaces the first export
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    reloaded = PeftModel.from_pretrained(load_base_model(model_dir), str(out))
    want, got = lora_state_dict(model_b), lora_state_dict(reloaded)
    assert all(torch.equal(want[k], got[k]) for k in want)


# ---------------------------------------------------------------- training.resume


def test_resume_auto_continues_the_newest_and_starts_fresh_in_an_empty_folder(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=3, job_uid="job-a")
    assert mgr.start_from("auto") is None
    mgr.save(4, model, opt, {})
    mgr.save(8, model, opt, {})
    assert mgr.start_from("auto").step == 8
    assert mgr.start_from_shared("auto").step == 8


def test_resume_never_refuses_an_earlier_runs_checkpoints_naming_the_folder(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    root = tmp_path / "ckpt"
    CheckpointManager(root, keep_last=3).save(12, model, opt, {})  # an earlier run, no UID
    mgr = CheckpointManager(root, keep_last=3, job_uid="job-b")
    with pytest.raises(CheckpointError) as err:
        mgr.start_from("never")
    msg = str(err.value)
    assert str(root) in msg and "step-000012" in msg and "training.resume to auto" in msg
    assert "new training.outputDir" in msg
    # and nothing was touched
    assert [p.name for p in root.iterdir()] == ["step-000012"]
    with pytest.raises(CheckpointError, match="resume is never"):
        CheckpointManager(root, keep_last=3).start_from("never")  # no UID: any is earlier


def test_resume_never_still_continues_this_jobs_own_checkpoints(model_dir, tmp_path):
    """A restart of the job's own pods continues: starting over would lose the run."""
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=3, job_uid="job-c")
    assert mgr.start_from("never") is None
    mgr.save(6, model, opt, {})
    assert mgr.start_from("never").step == 6


def test_resume_required_refuses_an_empty_folder_and_continues_otherwise(model_dir, tmp_path):
    model, opt = _trained(model_dir)
    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=3, job_uid="job-d")
    with pytest.raises(CheckpointError, match="resume is required") as err:
        mgr.start_from("required")
    assert str(tmp_path / "ckpt") in str(err.value)
    with pytest.raises(CheckpointError, match="resume is required"):
        mgr.start_from_shared("required")
    mgr.save(3, model, opt, {})
    assert mgr.start_from("required").step == 3
    with pytest.raises(ValueError, match="auto, never or required"):
        mgr.start_from("sometimes")


def test_the_trainer_applies_the_jobs_resume_policy(tmp_path):
    """Trainer.resume asks the manager under spec.training.resume (before any collective)."""
    from lorarl.api.resource import LoRARLJob
    from lorarl.trainer.loop import Trainer

    doc = {
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {"name": "j"},
        "spec": {
            "model": {"path": "/models/m"},
            "data": {"trainFiles": ["t.jsonl"]},
            "training": {"resume": "required"},
        },
    }
    trainer = Trainer.__new__(Trainer)  # only what resume() reads
    trainer.job = LoRARLJob.model_validate(doc)
    trainer.checkpoints = CheckpointManager(tmp_path, keep_last=3, job_uid="job-e")
    trainer.tracker = None
    trainer._publish = lambda: None
    with pytest.raises(CheckpointError, match="resume is required"):
        trainer.resume()
