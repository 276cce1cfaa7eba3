"""One vLLM OpenAI server (CPU, fp32, under the engine interpreter) over a plain Hugging Face
folder, for tests that check what vLLM computes from an exported model."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from lorarl.engines.vllm import VLLM_CPU_MAX_NUM_SEQS
from lorarl.local.ports import free_port
from lorarl.plan.engines import SERVED_MODEL_NAME
from lorarl.rollout.vllm_engine import vllm_launch_command

API_KEY = "engine-key-for-tests"


def stop_server_group(proc: subprocess.Popen) -> None:
    """The API server forks an engine core; stop the whole session it was started in."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # the engine core may outlive the server
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def vllm_serving(
    model_dir: Path, work: Path, python: str, max_model_len: int = 256
) -> Iterator[str]:
    """vLLM serving `model_dir` as model "served"; yields its URL, killed (whole group) at exit."""
    port = free_port()
    argv, env = vllm_launch_command(
        model_dir, port, served_model_name="served", run_dir=work, dtype="float32",
        kv_cache_gib=1, max_model_len=max_model_len, python=python, api_key=API_KEY,
        worker_extension_cls=None,
    )  # fmt: skip
    Path(env["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    log_path = work / "vllm.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not start:\n{log_path.read_text()[-5000:]}")
                time.sleep(0.5)
            yield url
        finally:
            stop_server_group(proc)


def greedy_with_logprobs(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy completion of token ids with the logprob of every sampled and prompt token:
    {"tokens", "logprobs", "prompt_logprobs" (none for the first prompt token)}."""
    body = {"model": "served", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "prompt_logprobs": 0, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    resp = httpx.post(
        f"{url}/v1/completions", json=body, timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )  # fmt: skip
    resp.raise_for_status()
    choice = resp.json()["choices"][0]
    prompt_lp = [
        d[str(t)]["logprob"] for d, t in zip(choice["prompt_logprobs"][1:], prompt[1:], strict=True)
    ]
    return {
        "tokens": choice["token_ids"],
        "logprobs": choice["logprobs"]["token_logprobs"],
        "prompt_logprobs": prompt_lp,
    }


SEEDED_PROMPT = "abcdefghijklmnopqrstuvwxyz"
VLLM_CPU_DEFAULT_BUDGET = 2048  # vLLM 0.32's CPU --max-num-batched-tokens when none is given


def seeded_prompts() -> list[str]:
    """A full step of one CPU engine: ~22-token prompts, more tokens in all than the default
    budget, so that budget would split a prefill (tests/e2e/test_vllm_sync_exact.py)."""
    return [SEEDED_PROMPT[: 20 + i % 5] for i in range(VLLM_CPU_MAX_NUM_SEQS)]


async def seeded_step(url: str, prompts: list[str], api_key: str) -> list[int]:
    """Every prompt at once, each request seeded, as a rollout step sends them; status codes
    (0: the connection failed)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(timeout=180, headers=headers) as client:

        async def one(prompt: str) -> int:
            body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                    "temperature": 1.0, "seed": 42, "logprobs": 1}  # fmt: skip
            try:
                return (await client.post(f"{url}/v1/completions", json=body)).status_code
            except httpx.HTTPError:
                return 0

        return list(await asyncio.gather(*map(one, prompts)))
