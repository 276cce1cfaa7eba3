"""Weight sync into a real vLLM engine is exact, version after version, for Llama and Qwen2.

The whole data path as a job runs it: the plan renders the engine command and the sidecar's env
(`LocalAddressing`), vLLM runs under the engine interpreter, `python -m lorarl.rollout.sidecar`
receives updates from a real `WeightPublisher` in this process over gloo. The trainer side is a
real PEFT model (`all-linear`, fp32) whose LoRA weights are perturbed for each of five versions.

After every version:
- merged mode: the weights vLLM computes with (read back through the worker extension) equal
  `W_base + s·B@A` of *that* version bit for bit, so nothing accumulates across versions;
- adapter mode: the adapter folder handed to vLLM holds the trainer's tensors bit for bit, vLLM
  serves it under the versioned name and the engine's base weights stay the checkpoint's;
- both: greedy tokens from `/v1/completions` equal PEFT's greedy decoding, and the per-token
  logprob gap vLLM fp32 vs PEFT fp32 stays <= 1e-3 mean (while the previous version is >= 1e-2
  away, so the bound can tell versions apart).

The adapter-mode engines then take a full step of seeded requests: vLLM 0.32 on CPU dies ("CPU
Generator does not use offset") when a seeded prefill is split across scheduler steps, which its
default budget does to these; `engines.vllm.cpu_batch_budget` prevents it. (Here, not on an
engine of its own: a vLLM start costs 30-50 s.)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from peft import PeftModel
from safetensors.torch import load_file

from harness.engines.vllm_serve import VLLM_CPU_DEFAULT_BUDGET, seeded_prompts, seeded_step
from harness.workloads.tiny_models import make_tiny_model, make_tokenizer
from lorarl.api.resource import LoRARLJob
from lorarl.engines.vllm import vllm_cache_root
from lorarl.local.env_refs import with_engine_key
from lorarl.local.ports import free_port_block
from lorarl.local.processes import Child
from lorarl.plan import ContainerPlan, JobPlan, LocalAddressing, plan
from lorarl.plan.engines import SERVED_MODEL_NAME
from lorarl.rollout.vllm_engine import VLLMEngine
from lorarl.sync.names import group_lora_pairs
from lorarl.sync.protocol import adapter_name
from lorarl.trainer.fleet.publish import WeightPublisher
from lorarl.trainer.model.loading import (
    LoraSettings,
    apply_lora,
    load_base_model,
    lora_parameters,
    lora_state_dict,
    set_lora_state_dict,
)

RANK, ALPHA = 8, 12.0  # s = 1.5: not a power of two, so the scaling's rounding is exercised
SCALING = ALPHA / RANK
VERSIONS = 5
PERTURB_STD = 0.1
PROMPTS = ["12+34=", "repeat 5821: ", "The cat sat on"]
NEW_TOKENS = 8
ENGINE_KEY = "engine-key-for-tests"
SYNC_KEY = "sync-key-for-tests"
AUTH = {"Authorization": f"Bearer {ENGINE_KEY}"}
MODES = ("merged", "adapter")
MAX_MEAN_LOGPROB_GAP = 1e-3
MIN_STALE_GAP = 1e-2
# 2 layers x (q, k, v, o, gate, up, down): what 'all-linear' must reach on the tiny models.
TARGETED = 14
ENGINE_START_S = 300.0


def make_job(model_dir: Path, arch: str, mode: str) -> LoRARLJob:
    return LoRARLJob.model_validate(
        {
            "apiVersion": "lorarl.dev/v1alpha1",
            "kind": "LoRARLJob",
            "metadata": {"name": f"sync-{arch}-{mode}"},
            "spec": {
                "model": {"path": str(model_dir), "dtype": "float32"},
                "lora": {"rank": RANK, "alpha": ALPHA, "targetModules": ["all-linear"]},
                "data": {
                    "trainFiles": ["unused.jsonl"],
                    "maxPromptTokens": 48,
                    "maxResponseTokens": 16,
                },
                "trainer": {"gpusPerReplica": 0},
                "rollout": {
                    "engine": "vllm",
                    "replicas": 1,
                    "gpusPerReplica": 0,
                    "syncMode": mode,
                    "kvCacheGib": 1,
                },
            },
        }
    )


@dataclass
class Stack:
    job: LoRARLJob
    plan: JobPlan
    engine: VLLMEngine  # this test's own client to the engine: health, read-back
    url: str
    publisher: WeightPublisher
    adapters: Path  # where the sidecar writes adapter folders (adapter mode)
    run_dir: Path
    children: list[Child]


def _argv(container: ContainerPlan, python: str) -> list[str]:
    assert container.command[0] == "python", container.command
    return [python, *container.command[1:]]


def wait_ready(stack: Stack) -> None:
    """Healthy, then one request shaped like the test's: on CPU the first decode with logprobs
    pays a one-off warm-up of several seconds, better spent while the other engine starts."""
    t0 = time.perf_counter()
    engine_child = stack.children[0]
    deadline = time.monotonic() + ENGINE_START_S
    while not stack.engine.health():
        if engine_child.poll() is not None or time.monotonic() > deadline:
            pytest.fail(
                f"vLLM did not start (exit {engine_child.poll()}):\n{engine_child.tail(40)}"
            )
        time.sleep(0.25)
    healthy = time.perf_counter() - t0
    vllm_greedy(stack, SERVED_MODEL_NAME, [[5, 6, 7]] * len(PROMPTS))
    # The sidecar registers once its engine answers; the first publish must find it.
    if not stack.publisher.sender.wait_registered(1, timeout=60):
        pytest.fail(f"the sidecar never registered:\n{stack.children[1].tail(40)}")
    print(f"\n[{stack.job.name}] vLLM healthy after {healthy:.1f} s, warm after "
          f"{time.perf_counter() - t0:.1f} s")  # fmt: skip


@contextlib.contextmanager
def running_stack(root: Path, job: LoRARLJob, engine_python: str) -> Iterator[Stack]:
    """Engine + sidecar from the job's plan, as the local runner starts them; always stopped.

    Yields as soon as they are started (see `wait_ready`), so several stacks start in parallel.
    """
    root.mkdir(parents=True)
    config_path = root / "job.yaml"
    base_port = free_port_block(LocalAddressing.ports_needed(job.spec.rollout.replicas))
    job_plan = plan(job, LocalAddressing(base_port), config_path=str(config_path))
    config_path.write_text(yaml.safe_dump(job_plan.config, sort_keys=False))
    replica = job_plan.role("rollout").replicas[0]
    engine_c, sidecar_c = replica.containers
    assert (engine_c.name, sidecar_c.name) == ("engine", "sidecar")
    tmp = root / "tmp"
    tmp.mkdir()
    adapters = root / "adapters" / replica.name
    common = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    engine_env = {
        **common,
        "VLLM_CACHE_ROOT": vllm_cache_root(os.environ, str(Path.home())),
        "VLLM_CONFIG_ROOT": str(root / "vllm-config"),
        "RAY_TMPDIR": str(tmp),
        **with_engine_key(engine_c.env, ENGINE_KEY),
    }
    sidecar_env = {**common, "LORARL_ADAPTER_DIR": str(adapters), "LORARL_SYNC_TIMEOUT": "300",
                   "LORARL_SYNC_KEY": SYNC_KEY,
                   **with_engine_key(sidecar_c.env, ENGINE_KEY)}  # fmt: skip
    children = [
        Child("engine", _argv(engine_c, engine_python), engine_env, root / "logs" / "engine.log"),
        Child("sidecar", _argv(sidecar_c, sys.executable), sidecar_env, root / "logs" / "sc.log"),
    ]
    sync = job_plan.sync
    url = f"http://127.0.0.1:{engine_c.ports['engine']}"
    # The publisher hosts the sync store, so it exists before the sidecar dials it.
    publisher = WeightPublisher(sync.address, sync.port, sync.mode, backend=sync.backend,
                                timeout_s=300, key=SYNC_KEY)  # fmt: skip
    engine = VLLMEngine(url, api_key=ENGINE_KEY)
    try:
        for child in children:
            child.start()
        yield Stack(job, job_plan, engine, url, publisher, adapters / job.name, root, children)
    finally:
        with contextlib.suppress(Exception):
            publisher.close()  # the sidecar exits 0 when told the channel closed
        engine.close()
        for child in reversed(children):
            child.stop()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_stacks(request, tmp_path_factory, engine_python: str) -> Iterator[dict[str, Stack]]:
    """Both modes' stacks for one architecture, started together: engine start-up is mostly
    single-threaded imports, so two overlap well on two cores."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model_dir = make_tiny_model(root / "model", arch=arch, init_std=0.1)
    with contextlib.ExitStack() as exits:
        stacks = {
            mode: exits.enter_context(
                running_stack(root / mode, make_job(model_dir, arch, mode), engine_python)
            )
            for mode in MODES
        }
        with ThreadPoolExecutor(len(stacks)) as pool:
            list(pool.map(wait_ready, stacks.values()))
        yield stacks


# ---------------------------------------------------------------- trainer-side reference


def perturb(model: PeftModel, gen: torch.Generator) -> None:
    """A random step on every LoRA tensor (A and B), like an optimizer step but bigger."""
    with torch.no_grad():
        for _, param in lora_parameters(model):
            param.add_(torch.randn(param.shape, generator=gen) * PERTURB_STD)


def expected_merged(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]):
    """HF weight name -> W_base + s·(B @ A), computed here in fp32 from the trainer's tensors."""
    out = {}
    for module, pair in group_lora_pairs(tensors).items():
        name = f"{module}.weight"
        out[name] = base[name] + (pair.B @ pair.A) * SCALING
    return out


@torch.no_grad()
def peft_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt) :]


@torch.no_grad()
def peft_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logprob of each of `tokens` after `prompt` (teacher forcing), fp32."""
    logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return logp[positions, torch.tensor(tokens)]


# ---------------------------------------------------------------- engine side


def read_served(stack: Stack, names: list[str], tag: str) -> dict[str, torch.Tensor]:
    out = stack.run_dir / f"served-{tag}.safetensors"
    shapes = stack.engine.collective_rpc("lorarl_read_weights", names=names, out_path=str(out))
    assert set(shapes[0]) == set(names)
    return load_file(str(out))


def vllm_greedy(stack: Stack, model: str, prompts: list[list[int]]):
    """[(token ids, logprobs)] per prompt, one batched request at temperature 0."""
    body = {"model": model, "prompt": prompts, "max_tokens": NEW_TOKENS, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120, headers=AUTH)
    assert resp.status_code == 200, resp.text[:1000]
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts)
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


def served_models(stack: Stack) -> set[str]:
    resp = httpx.get(f"{stack.url}/v1/models", timeout=30, headers=AUTH)
    assert resp.status_code == 200, resp.text
    return {m["id"] for m in resp.json()["data"]}


def check_adapter_folder(stack: Stack, version: int, tensors: dict[str, torch.Tensor]) -> None:
    folder = stack.adapters / adapter_name(version)
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert set(saved) == set(tensors)
    for name, tensor in tensors.items():
        assert saved[name].dtype == tensor.dtype and torch.equal(saved[name], tensor), name
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (RANK, ALPHA, False)
    leaves = {m.rsplit(".", 1)[-1] for m in group_lora_pairs(tensors)}
    assert set(config["target_modules"]) == leaves
    if version > 1:  # the previous version was unloaded and its folder removed
        assert not (stack.adapters / adapter_name(version - 1)).exists()


def check_served_weights(stack, mode, version, tensors, base) -> str:
    """Merged: served == W_base + s·B@A of this version. Adapter: base untouched, the folder
    holds the trainer's tensors, vLLM serves it by its versioned name. Returns that name."""
    names = [f"{m}.weight" for m in group_lora_pairs(tensors)]
    served = read_served(stack, names, f"v{version}")
    if mode == "merged":
        want = expected_merged(base, tensors)
        for name in names:
            assert torch.equal(served[name], want[name]), f"v{version} {name}"
            assert not torch.equal(served[name], base[name]), f"v{version} {name}"
        return SERVED_MODEL_NAME
    for name in names:
        assert torch.equal(served[name], base[name]), f"v{version} {name}"
    check_adapter_folder(stack, version, tensors)
    models = served_models(stack)
    assert adapter_name(version) in models and adapter_name(version - 1) not in models, models
    return adapter_name(version)


@contextlib.contextmanager
def lora_as(model: PeftModel, tensors: dict | None, restore: dict) -> Iterator[None]:
    """The model at another version for a moment (None: the base model, adapter disabled)."""
    if tensors is None:
        with model.disable_adapter():
            yield
        return
    set_lora_state_dict(model, tensors)
    try:
        yield
    finally:
        set_lora_state_dict(model, restore)


def compare_generations(stack, served_name, model, prompts, previous) -> dict[str, float]:
    """Greedy tokens equal; logprob gap to this version small, to the previous one large."""
    results = vllm_greedy(stack, served_name, prompts)
    gaps, stale = [], []
    for prompt, (tokens, logprobs) in zip(prompts, results, strict=True):
        assert tokens == peft_greedy(model, prompt, NEW_TOKENS), (prompt, tokens)
        served = torch.tensor(logprobs, dtype=torch.float64)
        gaps.append((served - peft_logprobs(model, prompt, tokens).double()).abs())
        with previous():
            stale.append((served - peft_logprobs(model, prompt, tokens).double()).abs())
    gap, stale_gap = torch.cat(gaps), torch.cat(stale)
    return {"mean": gap.mean().item(), "max": gap.max().item(), "stale": stale_gap.mean().item()}


# ---------------------------------------------------------------- the test


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The engine and sidecar share the cores: two spinning OpenMP threads here made each tiny
    forward ~100x slower (measured 0.05 s vs 1-6 s for the PEFT side of one version)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.usefixtures("one_torch_thread")
def test_five_versions_sync_exactly(arch_stacks: dict[str, Stack], mode: str) -> None:
    t_start = time.perf_counter()
    stack = arch_stacks[mode]
    assert stack.plan.sync.mode == mode
    engine_argv = stack.plan.role("rollout").replicas[0].containers[0].command
    assert "--worker-extension-cls" in engine_argv  # the read-back below depends on it
    model_dir = Path(stack.job.spec.model.path)
    base = load_file(str(model_dir / "model.safetensors"))
    model = apply_lora(load_base_model(model_dir, "float32"), LoraSettings(rank=RANK, alpha=ALPHA))
    model.eval()
    tok = make_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    gen = torch.Generator().manual_seed(1234)

    previous: dict[str, torch.Tensor] | None = None
    gaps, timings = [], []
    for version in range(1, VERSIONS + 1):
        perturb(model, gen)
        # Cloned: on CPU lora_state_dict aliases the live parameters.
        tensors = {k: v.clone() for k, v in lora_state_dict(model).items()}
        assert len(group_lora_pairs(tensors)) == TARGETED, sorted(group_lora_pairs(tensors))
        t0 = time.perf_counter()
        status = stack.publisher.publish(model, tensors, version)
        assert (status.version, status.mode) == (version, mode)
        t1 = time.perf_counter()
        served_name = check_served_weights(stack, mode, version, tensors, base)
        t2 = time.perf_counter()
        stale = functools.partial(lora_as, model, previous, tensors)
        gap = compare_generations(stack, served_name, model, prompts, stale)
        timings.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        assert gap["mean"] <= MAX_MEAN_LOGPROB_GAP, (version, gap)
        assert gap["stale"] >= MIN_STALE_GAP, (version, gap)
        gaps.append(gap)
        previous = tensors

    mean_s = [sum(column) / VERSIONS for column in zip(*timings, strict=True)]
    measured = {
        "logprob_gap_mean_worst_version": max(g["mean"] for g in gaps),
        "logprob_gap_max": max(g["max"] for g in gaps),
        "stale_gap_mean_min": min(g["stale"] for g in gaps),
        "publish_s": mean_s[0],
        "weights_check_s": mean_s[1],
        "generate_check_s": mean_s[2],
        "test_s": time.perf_counter() - t_start,
    }
    print(f"[{stack.job.name}] " + json.dumps(measured))


# ---------------------------------------------------------------- a full step of seeded requests


@pytest.mark.slow
def test_a_full_step_of_seeded_requests_on_one_cpu_engine(arch_stacks: dict[str, Stack]) -> None:
    stack = arch_stacks["adapter"]  # after the version checks: a crash here cannot hide theirs
    argv = stack.plan.role("rollout").replicas[0].containers[0].command
    assert "--max-num-batched-tokens" in argv and "--enable-lora" in argv
    prompts = seeded_prompts()
    tok = make_tokenizer()
    waiting = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    assert waiting > VLLM_CPU_DEFAULT_BUDGET  # so the default budget would split a prefill
    codes = asyncio.run(seeded_step(stack.url, prompts, ENGINE_KEY))
    log = (stack.run_dir / "logs" / "engine.log").read_text()
    assert codes == [200] * len(prompts), log[-3000:]
    assert "does not use offset" not in log
    assert stack.engine.health(), log[-3000:]
