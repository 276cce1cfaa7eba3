"""The trainer on a GPU, built by the trainer's own code (`build_policy`, `collate`, the loop's
calls): its two-backend process group, FSDP2 + LoRA under bf16 mixed precision, PPO's critic,
checkpoints with CUDA state, and the engine-memory hand-off. One rank: NCCL refuses two ranks on
one GPU, and what is new here is the device, not the world size (CPU tests cover that)."""

from __future__ import annotations

import copy
import dataclasses
import math
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lorarl.api.validation import parse_job
from lorarl.local.ports import free_port
from lorarl.trainer.checkpoint.manager import CheckpointManager
from lorarl.trainer.fleet.engine_memory import EngineMemory
from lorarl.trainer.fleet.publish import gather_adapter
from lorarl.trainer.model.critic import VALUE_HEAD, actor_parameters, critic_parameters
from lorarl.trainer.model.loading import (
    load_base_model,
    lora_parameters,
    lora_state_dict,
    peft_to_param_names,
)
from lorarl.trainer.model.logprobs import reference_logprobs, sequence_logprobs
from lorarl.trainer.model.parallel import (
    CPU_BACKEND,
    GPU_BACKEND,
    DistContext,
    compute_dtype,
    init_distributed,
    shutdown_distributed,
)
from lorarl.trainer.model.precision import cpu_lora_autocast_dtype
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.actor import all_reduce_sum, update_policy
from lorarl.trainer.update.batch import TensorBatch, collate
from lorarl.trainer.update.policy import Policy, build_policy
from tests.gpu.conftest import torchrun_env

RANK = 8
ALPHA = 16.0
LAYERS = 2  # tiny_config's default
LINEARS = 7  # q k v o gate up down: lora.targetModules all-linear
PAD = 0
SPAWN_TIMEOUT_S = 180.0


# ------------------------------------------------------------------ shared by both test files


def job_doc(model_dir: Path, dtype: str, algorithm: str = "grpo") -> dict[str, Any]:
    """A GPU job as a user writes it: bf16 base (the GPU examples' model.dtype), mixed
    precision on (the default), a KL term so the reference pass runs inside every update."""
    spec: dict[str, Any] = {
        "model": {"path": str(model_dir), "dtype": dtype},
        "data": {"trainFiles": ["train.jsonl"]},
        "lora": {"rank": RANK, "alpha": ALPHA},
        "algorithm": {"name": algorithm, "groupSize": 4, "kl": {"coef": 0.05}},
        "training": {"totalSteps": 10, "promptsPerStep": 2, "microBatchSize": 4},
        "optim": {"lr": 5e-3},
        "trainer": {"gpusPerReplica": 1},
    }
    if algorithm == "ppo":
        spec["critic"] = {"warmupSteps": 0}
    return {
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {"name": "gpu-test"},
        "spec": spec,
    }


def build(
    model_dir: Path,
    ctx: DistContext,
    dtype: str = "bfloat16",
    seed: int = 0,
    algorithm: str = "grpo",
) -> Policy:
    """The policy exactly as `lorarl.trainer` builds it (load, LoRA, shard, optimizer); `seed`
    draws the LoRA A init."""
    base = load_base_model(model_dir, dtype)  # type: ignore[arg-type]
    torch.manual_seed(seed)
    return build_policy(parse_job(job_doc(model_dir, dtype, algorithm)), base, ctx)


def rl_samples(n: int = 8, seed: int = 1) -> list[TrainSample]:
    """A step's samples: ragged prompts and completions, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = 5 + i % 3, 4 + (3 * i) % 7
        ids = torch.randint(4, 100, (p + c,), generator=g).tolist()
        adv = 1.0 if i % 2 else -1.0
        out.append(TrainSample(ids[:p], ids[p:], [-4.0] * c, adv, float(i % 2), 0))
    return out


def rl_batch(device: torch.device) -> TensorBatch:
    return collate(rl_samples(), PAD, device)  # as the loop does: on the trainer's device


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def step(policy: Policy, batch: TensorBatch) -> dict[str, float]:
    """One RL update as the loop calls it."""
    return update_policy(
        policy.model, policy.optimizer, batch, policy.update_cfg, reference=policy.kl_reference
    )


# ------------------------------------------------------------------ the process group


def _process_group_worker(port: int, results: Any) -> None:
    """A fresh process, as torchrun starts a trainer rank: join, then run every kind of
    collective the trainer runs on its default group, and report what carried each."""
    os.environ.update(torchrun_env(port))
    try:
        ctx = init_distributed()
        group = dist.distributed_c10d._get_default_group()
        host = torch.tensor([1.0, 2.0])
        dist.all_reduce(host)  # the loop's counts and metrics
        dev = torch.tensor([3.0], device=ctx.device)
        dist.all_reduce(dev)  # FSDP's collectives
        box: list[Any] = [{"step": 3}]
        dist.broadcast_object_list(box, src=0)  # checkpoints: rank 0's outcome
        gathered: list[Any] = [None]
        dist.all_gather_object(gathered, {"rank": ctx.rank})  # checkpoints: every rank's RNG
        dist.barrier()  # engine_memory.after_update
        mesh = init_device_mesh(ctx.device.type, (1,))
        whole = torch.arange(6.0, device=ctx.device)
        regathered = distribute_tensor(whole, mesh, [Shard(0)]).full_tensor()  # lora_state_dict
        types = {"cpu", ctx.device.type}
        report = {
            "backend": ctx.backend,
            "device": str(ctx.device),
            "carriers": {t: type(group._get_backend(torch.device(t))).__name__ for t in types},
            "host": (host.tolist(), host.device.type),
            "dev": (dev.tolist(), str(dev.device)),
            "sums": all_reduce_sum([1.0, 2.5]),
            "objects": (box[0], gathered),
            "dtensor": (regathered.tolist(), str(regathered.device)),
        }
        shutdown_distributed(ctx, barrier=True)
        report["left"] = not dist.is_initialized()
        results.put(("ok", report))
    except BaseException:
        results.put(("error", traceback.format_exc()))


def run_spawned(target: Callable[..., None], *args: Any) -> dict[str, Any]:
    """`target(*args, results)` in a spawned process (its default group dies with it); a child
    that dies without reporting fails at once, not after the timeout."""
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    proc = spawn.Process(target=target, args=(*args, results), daemon=True)
    proc.start()
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while True:
            try:
                status, payload = results.get(timeout=1.0)
                break
            except queue.Empty:
                if not proc.is_alive() or time.monotonic() > deadline:
                    pytest.fail(f"{target.__name__} reported nothing (exit code {proc.exitcode})")
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if status != "ok":
        pytest.fail(f"{target.__name__} failed:\n{payload}")
    return payload


def test_init_distributed_routes_cpu_tensors_to_gloo_and_cuda_tensors_to_nccl(device):
    report = run_spawned(_process_group_worker, free_port())
    if device.type == "cuda":
        assert report["backend"] == GPU_BACKEND == "cpu:gloo,cuda:nccl"
        assert report["device"] == "cuda:0"
        assert report["carriers"] == {"cpu": "ProcessGroupGloo", "cuda": "ProcessGroupNCCL"}
    else:
        assert report["backend"] == CPU_BACKEND
        assert report["carriers"] == {"cpu": "ProcessGroupGloo"}
    assert report["host"] == ([1.0, 2.0], "cpu")
    assert report["dev"] == ([3.0], report["device"])
    assert report["sums"] == [1.0, 2.5]
    assert report["objects"] == ({"step": 3}, [{"rank": 0}])
    assert report["dtensor"] == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], report["device"])
    assert report["left"]


# ------------------------------------------------------------------ FSDP2 + LoRA


def record_output_dtypes(module: torch.nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fsdp2_lora_update_trains_only_the_adapter_in_bf16(
    trainer_ctx, tiny_model_dir, device, dtype
):
    ctx = trainer_ctx
    cuda = device.type == "cuda"
    policy = build(tiny_model_dir, ctx, dtype)
    model, mbs = policy.model, policy.update_cfg.micro_batch_size
    assert ctx.distributed and ctx.device == device
    # The compute dtype (and the sync's wire dtype): bf16 from FSDP2 on GPU; no CPU autocast.
    assert compute_dtype(ctx, True) == (torch.bfloat16 if cuda else None)
    autocast = torch.bfloat16 if not cuda and dtype == "bfloat16" else None
    assert cpu_lora_autocast_dtype(model, ctx.device, True) == autocast
    lora = dict(lora_parameters(model))
    assert len(lora) == 2 * LINEARS * LAYERS
    for p in lora.values():  # sharded fp32 masters on the device; AdamW steps these
        assert isinstance(p, DTensor) and p.dtype == torch.float32
        assert p.to_local().device.type == device.type
    lora_a = next(m for n, m in model.named_modules() if n.endswith("q_proj.lora_A.default"))
    lora_dtypes = record_output_dtypes(lora_a)
    lora_before = {n: full(p).clone() for n, p in lora.items()}
    base_before = {n: full(p).clone() for n, p in model.named_parameters() if n not in lora}

    batch = rl_batch(device)
    mask = batch.response_mask.bool()
    args = (batch.input_ids, batch.attention_mask, batch.response_mask)
    with torch.no_grad():
        initial, _ = sequence_logprobs(model, *args, micro_batch_size=mbs)
    metrics = [step(policy, batch) for _ in range(3)]
    with torch.no_grad():
        trained, _ = sequence_logprobs(model, *args, micro_batch_size=mbs)
    reference = reference_logprobs(model, *args, micro_batch_size=mbs)

    for m in metrics:
        for key in ("loss", "policy_loss", "kl", "entropy", "grad_norm", "logprob_mismatch"):
            assert math.isfinite(m[key]), (key, m)
    assert metrics[0]["grad_norm"] > 0 and metrics[-1]["kl"] > 0
    low_precision = cuda or dtype == "bfloat16"
    assert set(lora_dtypes) == {torch.bfloat16 if low_precision else torch.float32}
    assert initial.device == trained.device == reference.device == device
    # The adapter disabled is the base: the policy before any update (B starts at 0).
    tol = 2e-2 if low_precision else 1e-5
    assert (reference - initial)[mask].abs().max() <= tol
    assert (trained - initial)[mask].abs().max() > 10 * tol  # and the adapter did move it
    assert all(not torch.equal(full(p), lora_before[n]) for n, p in lora.items())
    frozen = dict(model.named_parameters())
    assert base_before and all(torch.equal(full(frozen[n]), w) for n, w in base_before.items())

    adapter = gather_adapter(model)  # what the sync ships and checkpoints keep
    names = peft_to_param_names(model)
    assert set(adapter) == set(names) and len(adapter) == len(lora)
    for peft_name, t in adapter.items():
        assert ".default." not in peft_name
        assert peft_name.endswith((".lora_A.weight", ".lora_B.weight"))
        assert type(t) is torch.Tensor and t.device.type in ("cpu", "cuda")
        assert t.dtype == torch.float32 and RANK in t.shape
        assert torch.equal(t.cpu(), full(lora[names[peft_name]]).cpu())


def test_ppo_critic_and_value_head_train_beside_the_actor(trainer_ctx, tiny_model_dir, device):
    """PPO's value head is its own fp32 FSDP unit and the critic's decoder pass a registered
    FSDP forward method: both must gather and train under mixed precision."""
    policy = build(tiny_model_dir, trainer_ctx, "bfloat16", algorithm="ppo")
    model = policy.model
    assert policy.ppo is not None
    head_dtypes = record_output_dtypes(getattr(model, VALUE_HEAD))
    params = [*actor_parameters(model), *critic_parameters(model)]
    before = {n: full(p).clone() for n, p in params}
    batch = rl_batch(device)
    # The head starts at 0 and each LoRA's B too: the critic's A gets a gradient at step 3.
    metrics = [policy.ppo.update(batch, n, reference=policy.kl_reference) for n in (1, 2, 3)]
    for m in metrics:
        for key in ("loss", "value_loss", "critic_grad_norm", "explained_variance"):
            assert math.isfinite(m[key]), (key, m)
    assert set(head_dtypes) == {torch.float32}
    stuck = [n for n, p in params if torch.equal(full(p), before[n])]
    assert not stuck, f"not trained: {stuck[:4]}"


# ------------------------------------------------------------------ checkpoints


def full_optimizer_state(policy: Policy) -> dict[str, Any]:
    """A copy: on CPU the full state may share storage with the live one."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return copy.deepcopy(get_optimizer_state_dict(policy.model, policy.optimizer, options=options))


def adapter_copy(policy: Policy) -> dict[str, torch.Tensor]:
    """`lora_state_dict` copied: on CPU (one rank) its tensors are the parameters' storage."""
    return {n: t.clone() for n, t in lora_state_dict(policy.model).items()}


def test_checkpoint_round_trips_adapter_optimizer_state_and_cuda_rng(
    trainer_ctx, tiny_model_dir, device, tmp_path
):
    cuda = device.type == "cuda"
    batch = rl_batch(device)
    first = build(tiny_model_dir, trainer_ctx, seed=0)
    step(first, batch)
    step(first, batch)
    manager = CheckpointManager(tmp_path / "checkpoints")
    cuda_rng = torch.cuda.get_rng_state(device) if cuda else None
    optim_saved = full_optimizer_state(first)
    manager.save(2, first.model, first.optimizer, {"position": 7})
    adapter_saved = adapter_copy(first)
    step(first, batch)
    continued = adapter_copy(first)
    if cuda:
        torch.rand(16, device=device)  # moves the CUDA generator on

    resumed = build(tiny_model_dir, trainer_ctx, seed=99)  # another LoRA init, fresh AdamW
    ckpt = manager.latest()
    assert ckpt is not None and ckpt.step == 2
    loaded = manager.load(ckpt, resumed.model, resumed.optimizer)
    assert loaded.trainer_state == {"position": 7}
    if cuda:
        assert "cuda" in loaded.rng_state
        assert torch.equal(torch.cuda.get_rng_state(device), cuda_rng)
    got = adapter_copy(resumed)
    assert got.keys() == adapter_saved.keys()
    assert all(torch.equal(got[n], adapter_saved[n]) for n in got)
    optim_loaded = full_optimizer_state(resumed)
    for key, state in optim_saved["state"].items():
        for name, value in state.items():
            assert torch.equal(optim_loaded["state"][key][name], value), (key, name)
    for state in resumed.optimizer.state.values():  # moments back on the parameters' device
        for name in ("exp_avg", "exp_avg_sq"):
            t = state[name]
            assert (t.to_local() if isinstance(t, DTensor) else t).device.type == device.type

    step(resumed, batch)
    after = adapter_copy(resumed)
    tol = 5e-5  # GPU attention backward may sum in another order: close, not bit-equal
    for n in continued:
        torch.testing.assert_close(after[n], continued[n], rtol=1e-3, atol=tol)

    fresh = build(tiny_model_dir, trainer_ctx, seed=99)
    manager.load(ckpt, fresh.model, None)  # the adapter only: AdamW starts over
    step(fresh, batch)
    moved = adapter_copy(fresh)
    drift = max((moved[n] - continued[n]).abs().max() for n in continued)
    assert drift > 20 * tol, drift  # so the optimizer state is what made the resumed step match


# ------------------------------------------------------------------ engine memory


def test_after_update_returns_cached_gpu_memory_then_wakes_the_engines(trainer_ctx, device):
    """Colocated engines sleep through the update; before they wake every rank hands back its
    cached blocks and meets the others on the trainer's group (a barrier on NCCL on GPU)."""
    routes: list[str] = []

    def engine(request: httpx.Request) -> httpx.Response:
        routes.append(request.url.path)
        status = "awake" if request.url.path == "/wake_up" else "sleeping"
        return httpx.Response(200, json={"status": status})

    http = httpx.Client(transport=httpx.MockTransport(engine))
    memory = EngineMemory(True, "vllm", http, "key", live=lambda: ["http://engine:8000"])
    memory.release()
    cuda = device.type == "cuda"
    block_bytes = 256 * 2**20
    if cuda:
        torch.cuda.empty_cache()
        floor = torch.cuda.memory_reserved(device)
        block = torch.empty(block_bytes, dtype=torch.uint8, device=device)
        del block  # freed, but the caching allocator keeps it from the engine
        assert torch.cuda.memory_reserved(device) >= floor + block_bytes
    memory.after_update(is_main=True)
    if cuda:  # the block went back (the barrier may keep a small segment of its own)
        assert torch.cuda.memory_reserved(device) < floor + block_bytes // 2
    assert routes == ["/sleep", "/wake_up"] and memory.released == []


def test_skipping_samples_without_advantage_on_the_gpu_gives_the_same_step(
    trainer_ctx, tiny_model_dir, device, monkeypatch
):
    """No KL term: a GRPO group whose rewards were equal (advantage 0) is not run, on the
    device's tensors (rows, lengths and the gathered logprobs live there); the step equals the
    one that runs every sample."""
    import lorarl.trainer.update.actor as update_module

    samples = [dataclasses.replace(s, advantage=0.0) if i < 4 else s
               for i, s in enumerate(rl_samples())]  # fmt: skip
    batch = collate(samples, PAD, device)

    def one_step(skipping: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        policy = build(tiny_model_dir, trainer_ctx, "bfloat16")
        cfg = dataclasses.replace(
            policy.update_cfg, loss=dataclasses.replace(policy.update_cfg.loss, kl_coef=0.0)
        )
        rows: list[int] = []
        hook = policy.model.get_base_model().model.register_forward_pre_hook(
            lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
        )
        with monkeypatch.context() as m:
            if not skipping:
                m.setattr(update_module, "gradient_free", lambda b, c: None)
            update_module.update_policy(policy.model, policy.optimizer, batch, cfg)
        hook.remove()
        grads = {n: full(p.grad).float().cpu() for n, p in lora_parameters(policy.model)}
        return grads, rows

    skipped, run_rows = one_step(True)
    everything, all_rows = one_step(False)
    assert sum(run_rows) == 4 and sum(all_rows) == 8
    # Gradients, not weights: AdamW's first step is about lr * sign(g), which turns a rounding
    # difference in a near-zero gradient into a full step.
    total = torch.cat([g.flatten() for g in everything.values()])
    gap = torch.cat([(skipped[n] - g).flatten() for n, g in everything.items()])
    assert total.norm() > 0 and gap.norm() <= 3e-2 * total.norm()  # bf16 compute
