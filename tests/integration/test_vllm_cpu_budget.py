"""One CPU vLLM engine started with the plan's flags serves a full step of seeded requests.

vLLM 0.32 on CPU dies ("CPU Generator does not use offset") when a seeded request's prefill is
split across scheduler steps; with its default CPU budget (2048 tokens) 128 concurrent requests of
~25 tokens split one. The cluster e2e's one-replica job found it (every rollout request then
failed). `plan.engines.cpu_batch_budget` sizes the budget so no prefill is split; without it
this test kills the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from lorarl.local.ports import free_port
from lorarl.plan.engines import vllm_server_args, vllm_server_env
from tests.support.tiny_models import make_tiny_model

REQUESTS, MAX_MODEL_LEN = 128, 36
PROMPT = "abcdefghijklmnopqrstuvwxyz"


async def _step(url: str) -> list[int]:
    async with httpx.AsyncClient(timeout=180) as client:

        async def one(i: int) -> int:
            body = {"model": "base", "prompt": PROMPT[: 20 + i % 5], "max_tokens": 4,
                    "temperature": 1.0, "seed": 42, "logprobs": 1}  # fmt: skip
            try:
                return (await client.post(f"{url}/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return 0

        return list(await asyncio.gather(*(one(i) for i in range(REQUESTS))))


def test_a_full_step_of_seeded_requests_on_one_cpu_engine(
    tmp_path: Path, engine_python: str
) -> None:
    model = make_tiny_model(tmp_path / "model", arch="llama")
    port = free_port()
    args = vllm_server_args(model, "127.0.0.1", port, dtype="float32", seed=42,
                            max_model_len=MAX_MODEL_LEN, max_lora_rank=8)  # fmt: skip
    assert "--max-num-batched-tokens" in args
    env = {**os.environ, **vllm_server_env(cpu=True), "TMPDIR": str(tmp_path),
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}  # fmt: skip
    log = tmp_path / "vllm.log"
    with log.open("w") as out:
        proc = subprocess.Popen([engine_python, *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "vLLM did not start"
            time.sleep(0.5)
        codes = asyncio.run(_step(url))
        assert codes == [200] * REQUESTS, log.read_text()[-3000:]
        assert "does not use offset" not in log.read_text()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


pytestmark = pytest.mark.slow
