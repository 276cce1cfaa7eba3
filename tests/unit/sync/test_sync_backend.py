"""The sync group's backend and device: the plan's choice, read the same way on both ends, and
buffers placed where the backend can move them (NCCL rejects CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from lorarl.sync.errors import SyncError
from lorarl.sync.transport import SyncReceiver, SyncSender, backend_from_env, device_for


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_backend_comes_from_the_plan_env(backend: str) -> None:
    assert backend_from_env({"LORARL_SYNC_BACKEND": backend}) == backend


@pytest.mark.parametrize("env", [{}, {"LORARL_SYNC_BACKEND": ""}, {"LORARL_SYNC_BACKEND": "auto"}])
def test_a_missing_or_unknown_backend_is_an_error_not_a_guess(env: dict[str, str]) -> None:
    with pytest.raises(SyncError, match="LORARL_SYNC_BACKEND must be one of gloo, nccl"):
        backend_from_env(env)


def test_gloo_buffers_live_in_host_memory_nccl_buffers_on_the_current_gpu(monkeypatch) -> None:
    assert device_for("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_for("nccl") == torch.device("cuda", 3)
    assert device_for("gloo", "cpu") == torch.device("cpu")
    with pytest.raises(SyncError, match="backend must be one of gloo, nccl, got 'mpi'"):
        device_for("mpi")


def test_both_ends_refuse_a_bad_backend_before_touching_the_network() -> None:
    with pytest.raises(SyncError):
        SyncSender("127.0.0.1", 0, backend="auto")
    with pytest.raises(SyncError):
        SyncReceiver("127.0.0.1", 1, 0, backend="auto", timeout=0.1)
