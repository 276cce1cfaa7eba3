"""GPU-only tests: the device paths no CPU run reaches (the `cpu:gloo,cuda:nccl` group, FSDP2
mixed precision, CUDA tensors staged through the gloo weight sync, CUDA RNG and optimizer state
in checkpoints). Without CUDA every test here is skipped.

`LORARL_GPU_TESTS_ON_CPU=1` runs the same bodies on CPU (gloo, no mixed precision) so their own
logic can be checked on a machine without a GPU; assertions that only hold on a GPU (bf16
compute, CUDA memory) are conditioned on the device type. How the GPU run is launched:
tests/gpu/README.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lorarl.trainer.model.parallel import DistContext, init_distributed, shutdown_distributed

ON_CPU_ENV = "LORARL_GPU_TESTS_ON_CPU"
HERE = Path(__file__).resolve().parent


def on_cpu() -> bool:
    return os.environ.get(ON_CPU_ENV) == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A hook in this conftest sees the whole session's items: only ours are skipped."""
    if torch.cuda.is_available() or on_cpu():
        return
    skip = pytest.mark.skip(
        reason=f"no CUDA device (torch.cuda.is_available() is False); {ON_CPU_ENV}=1 runs "
        "these bodies on CPU to check their logic"
    )
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cpu") if on_cpu() else torch.device("cuda", 0)


def torchrun_env(port: int) -> dict[str, str]:
    """What torchrun gives a one-process job: init_distributed takes the process-group path."""
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.fixture(scope="session")
def trainer_ctx() -> Iterator[DistContext]:
    """This process as a one-rank trainer, joined the way `lorarl.trainer` joins (env://, so the
    variables go into os.environ). One group for the session: the default group is global."""
    from lorarl.local.ports import free_port

    with pytest.MonkeyPatch.context() as mp:
        for name, value in torchrun_env(free_port()).items():
            mp.setenv(name, value)
        ctx = init_distributed()
        try:
            yield ctx
        finally:
            shutdown_distributed(ctx)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny Llama (head_dim 64) as a Hugging Face folder, fp32 weights; init_std 0.1
    so a few LoRA steps visibly move the logprobs."""
    from lorarl.local.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), init_std=0.1)
