"""The trainer's process group: which backend serves which device. No GPU here, so the GPU
choice is tested as the exact arguments `init_process_group` receives and as torch's own parse of
them; the CPU half runs for real."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from lorarl.trainer.model import parallel
from lorarl.trainer.model.parallel import init_distributed, placement


def test_placement_on_cpu_and_on_gpu() -> None:
    assert placement(False, 1) == (torch.device("cpu"), "gloo")
    assert placement(True, 3) == (torch.device("cuda", 3), "cpu:gloo,cuda:nccl")


@pytest.mark.parametrize(
    ("cuda", "expected"),
    [(False, {"cpu": "gloo", "cuda": "gloo"}), (True, {"cpu": "gloo", "cuda": "nccl"})],
)
def test_cpu_tensors_always_have_a_backend(cuda: bool, expected: dict[str, str]) -> None:
    """An NCCL-only group has no backend for CPU tensors (the loop's token counts, metrics and
    object collectives are CPU tensors): the GPU group must map cpu to gloo."""
    _, backend = placement(cuda, 0)
    assert BackendConfig(Backend(backend)).get_device_backend_map() == expected


def test_init_distributed_on_a_gpu_node_creates_the_two_backend_group(monkeypatch) -> None:
    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.setdefault("pg", kw))
    env = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="m", MASTER_PORT="1")
    ctx = init_distributed(env)
    assert calls["pg"] == {"backend": "cpu:gloo,cuda:nccl", "rank": 5, "world_size": 8}
    assert calls["device"] == torch.device("cuda", 1) == ctx.device
    assert ctx.backend == parallel.GPU_BACKEND


def test_the_loops_cpu_collectives_run_on_a_device_mapped_group() -> None:
    """A real group from a `device:backend` string: update.py's CPU all-reduce and an object
    broadcast go through its cpu backend (a separate process: the default group is global)."""
    code = textwrap.dedent(
        """
        import torch.distributed as dist
        from lorarl.trainer.update.actor import all_reduce_sum
        dist.init_process_group(backend="cpu:gloo", init_method="tcp://127.0.0.1:0",
                                rank=0, world_size=1)
        assert all_reduce_sum([1.0, 2.5]) == [1.0, 2.5]
        box = [{"step": 3}]
        dist.broadcast_object_list(box, src=0)
        dist.destroy_process_group()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
