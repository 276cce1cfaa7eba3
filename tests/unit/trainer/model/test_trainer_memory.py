"""Trainer memory features: activation checkpointing (same gradients, layers recomputed), FSDP2
CPU offload (the policy fully_shard gets, refused on CPU) and micro-batches cut by a token budget
(packing, rank balancing, the update's gradient unchanged)."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from pydantic import ValidationError
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from transformers import AutoModelForCausalLM

import lorarl.trainer.model.micro_batches as micro_module
import lorarl.trainer.model.parallel as parallel
from harness.workloads.tiny_models import tiny_config
from lorarl.api.resource import LoRARLJob
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.model.memory import (
    activation_checkpointing_on,
    checkpoint_layers,
    checkpointing_summary,
    offload_policy,
)
from lorarl.trainer.model.micro_batches import (
    MicroBatch,
    balance,
    micro_cost,
    pack_by_tokens,
    row_lengths,
)
from lorarl.trainer.model.parallel import DistContext, decoder_layers, shard_model
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.actor import UpdateConfig, plan_micro_batches, update_policy
from lorarl.trainer.update.batch import collate

MINIMAL = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "mem"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama", init_std=0.1))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():  # non-zero B so A also gets gradients
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def mixed_batch(lengths: list[int], advantages: list[float] | None = None):
    g = torch.Generator().manual_seed(3)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(4, 100, (n,), generator=g).tolist()
        c = n - 3
        adv = float(i % 3 - 1) if advantages is None else advantages[i]
        samples.append(TrainSample(ids[:3], ids[3:], [-1.0 - 0.1 * i] * c, adv, 0.0, 0))
    return collate(samples, pad_id=0)


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_update(policy, tensors, *, checkpointing=False, record=None, **cfg):
    model = copy.deepcopy(policy)
    if checkpointing:
        checkpoint_layers(model)
    hook = None
    if record is not None:
        hook = model.get_base_model().model.register_forward_pre_hook(
            lambda _m, _a, kw: record.append(tuple(kw["input_ids"].shape)), with_kwargs=True
        )
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    cfg.setdefault("loss", LossConfig())
    cfg.setdefault("micro_batch_size", 2)
    try:
        metrics = update_policy(model, opt, tensors, UpdateConfig(grad_clip=1e9, **cfg))
    finally:
        if hook is not None:
            hook.remove()
    return grads_of(model), metrics


def assert_same_grads(got, want):
    assert want and set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6)


# ---- activation checkpointing ----


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_checkpointed_layers_give_the_same_gradients(policy, kl_coef):
    tensors = mixed_batch([9, 4, 7, 5, 8, 6])
    loss = LossConfig(kl_coef=kl_coef, entropy_coef=0.01)
    plain, _ = run_update(policy, tensors, loss=loss)
    ckpt, _ = run_update(policy, tensors, loss=loss, checkpointing=True)
    assert_same_grads(ckpt, plain)


def test_checkpointing_recomputes_under_the_cpu_bf16_lora_path_exactly(policy):
    """A bf16 base on CPU runs the LoRA path under autocast with PEFT's input casting off
    (`lora_precision.lora_compute`, around the forward only): the backward's recompute must give
    the same tensors, or non-reentrant checkpointing refuses them and the gradient changes."""
    from lorarl.trainer.model.precision import set_lora_autocast

    model = copy.deepcopy(policy)
    for name, p in model.named_parameters():
        if ".lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    set_lora_autocast(model, torch.bfloat16)
    tensors = mixed_batch([9, 4, 7, 5, 8, 6])
    loss = LossConfig(kl_coef=0.1)
    plain, _ = run_update(model, tensors, loss=loss)
    ckpt, _ = run_update(model, tensors, loss=loss, checkpointing=True)
    assert_same_grads(ckpt, plain)


def test_checkpointed_layers_are_recomputed_in_the_backward_and_keep_their_names(policy):
    """The feature itself: each layer's forward runs again in the backward (that is where the
    memory goes), not in a no-grad pass, and no parameter is renamed (sync and checkpoints key
    on the adapter's names)."""
    model = copy.deepcopy(policy)
    names = [n for n, _ in model.named_parameters()]
    assert checkpoint_layers(model) == 2 and checkpoint_layers(model) == 2  # idempotent
    assert checkpointing_summary(model) == (2, 2)
    assert [n for n, _ in model.named_parameters()] == names
    tensors = mixed_batch([6, 6])
    args = (tensors.input_ids, tensors.attention_mask, tensors.response_mask)

    def mlp_calls(m) -> list[bool]:
        calls: list[bool] = []
        for layer in decoder_layers(m):
            layer.mlp.register_forward_pre_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        return calls

    calls = mlp_calls(model)
    with torch.no_grad():
        sequence_logprobs(model, *args, micro_batch_size=2)
    assert calls == [False, False]  # no grad: each layer once, nothing to recompute
    calls.clear()
    lp, _ = sequence_logprobs(model, *args, micro_batch_size=2)
    assert len(calls) == 2
    lp.sum().backward()
    assert len(calls) == 4  # each layer recomputed once in the backward
    plain = copy.deepcopy(policy)
    plain_calls = mlp_calls(plain)
    lp, _ = sequence_logprobs(plain, *args, micro_batch_size=2)
    lp.sum().backward()
    assert len(plain_calls) == 2  # without the feature nothing is recomputed


def test_activation_checkpointing_default_is_on_for_gpu_trainers_only():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert activation_checkpointing_on(None, gpu) and not activation_checkpointing_on(None, cpu)
    assert activation_checkpointing_on(True, cpu) and not activation_checkpointing_on(False, gpu)
    spec = LoRARLJob.model_validate(MINIMAL).spec
    assert spec.trainer.activation_checkpointing is None
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["trainer"] = {"activationCheckpointing": True}
    assert LoRARLJob.model_validate(doc).spec.trainer.activation_checkpointing is True


def test_build_policy_checkpoints_the_layers_the_spec_asks_for(tmp_path):
    from lorarl.trainer.update.policy import build_policy

    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    for setting, expected in ((None, 0), (True, 2), (False, 0)):
        doc = copy.deepcopy(MINIMAL)
        doc["spec"]["trainer"] = {"gpusPerReplica": 0}
        if setting is not None:
            doc["spec"]["trainer"]["activationCheckpointing"] = setting
        job = LoRARLJob.model_validate(doc)
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(tiny_config("llama"))
        pol = build_policy(job, base, ctx)
        assert checkpointing_summary(pol.model) == (expected, 2), setting


# ---- FSDP2 CPU offload ----


def test_offload_policy_is_fsdp2s_cpu_offload_on_gpu_and_refused_on_cpu():
    on = offload_policy(True, torch.device("cuda", 0))
    assert isinstance(on, CPUOffloadPolicy) and on.pin_memory
    off = offload_policy(False, torch.device("cuda", 0))
    assert type(off) is OffloadPolicy  # the no-offload default fully_shard takes
    assert type(offload_policy(False, torch.device("cpu"))) is OffloadPolicy
    with pytest.raises(ValueError, match=r"trainer\.fsdp\.offloadParams"):
        offload_policy(True, torch.device("cpu"))


def test_shard_model_hands_the_offload_policy_to_every_fsdp_unit(policy, monkeypatch):
    seen: list[tuple[str, object]] = []
    monkeypatch.setattr(parallel, "init_device_mesh", lambda *a, **k: "mesh")
    monkeypatch.setattr(
        parallel, "fully_shard", lambda m, **kw: seen.append((type(m).__name__, kw))
    )
    ctx = DistContext(0, 2, 0, torch.device("cuda", 0), parallel.GPU_BACKEND)
    offload = offload_policy(True, ctx.device)
    shard_model(copy.deepcopy(policy), ctx, mixed_precision=True, offload=offload)
    assert len(seen) == 3  # two decoder layers, then the root
    assert all(kw["offload_policy"] is offload for _, kw in seen)
    seen.clear()
    shard_model(copy.deepcopy(policy), ctx, mixed_precision=True)
    assert all(type(kw["offload_policy"]) is OffloadPolicy for _, kw in seen)


def test_a_plain_process_refuses_cpu_offload(policy):
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    with pytest.raises(ValueError, match="offloadParams"):
        shard_model(copy.deepcopy(policy), ctx, offload=CPUOffloadPolicy())


def test_spec_refuses_offload_on_cpu_trainers_and_accepts_it_on_gpus():
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["trainer"] = {"gpusPerReplica": 0, "fsdp": {"offloadParams": True}}
    with pytest.raises(ValidationError, match="needs GPU trainers") as exc:
        LoRARLJob.model_validate(doc)
    assert exc.value.errors()[0]["ctx"]["field"] == "fsdp.offloadParams"
    doc["spec"]["trainer"]["gpusPerReplica"] = 8
    assert LoRARLJob.model_validate(doc).spec.trainer.fsdp.offload_params


def test_build_policy_refuses_offload_without_a_gpu():
    from lorarl.trainer.update.policy import build_policy

    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["trainer"] = {"gpusPerReplica": 1, "fsdp": {"offloadParams": True}}
    job = LoRARLJob.model_validate(doc)  # valid: the spec says GPUs; this pod found none
    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with pytest.raises(ValueError, match="offloadParams"):
        build_policy(job, base, DistContext(0, 1, 0, torch.device("cpu"), None))


# ---- micro-batches by token budget ----


def test_packing_keeps_order_and_both_limits():
    lengths = [3, 3, 4, 5, 5, 5, 9, 20, 21]
    micros = pack_by_tokens(lengths, max_tokens=16, max_rows=3)
    assert [i for m in micros for i in m] == list(range(len(lengths)))  # in order, each once
    assert micros == [[0, 1, 2], [3, 4, 5], [6], [7], [8]]
    for m in micros:
        assert len(m) <= 3 and (micro_cost(m, lengths) <= 16 or len(m) == 1)
    assert pack_by_tokens(lengths, 1000, 2) == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    assert pack_by_tokens(lengths, 16, 3) == micros  # deterministic
    assert pack_by_tokens([], 16, 3) == []
    with pytest.raises(ValueError):
        pack_by_tokens(lengths, 0, 3)


def test_balance_splits_to_the_other_ranks_count_then_adds_weightless_fillers():
    lengths = [2, 2, 2, 2, 8]
    micros = pack_by_tokens(lengths, max_tokens=8, max_rows=8)
    assert micros == [[0, 1, 2, 3], [4]]
    three = balance(micros, 3, lengths)
    assert [m.rows for m in three] == [[0, 1], [2, 3], [4]]
    assert all(m.weight == 1.0 for m in three)
    seven = balance(micros, 7, lengths)
    assert [m.rows for m in seven[:5]] == [[0], [1], [2], [3], [4]]
    assert seven[5:] == [MicroBatch([0], 0.0)] * 2
    with pytest.raises(ValueError):
        balance(micros, 1, lengths)


def test_row_lengths_are_what_a_micro_batch_runs():
    tensors = mixed_batch([4, 11, 6])
    assert row_lengths(tensors.attention_mask, tensors.response_mask) == [4, 11, 6]


def record_losses(monkeypatch) -> list[tuple[float, float, float]]:
    """(loss, tokens, sequences) of every micro-batch the update runs."""
    import lorarl.trainer.update.actor as update_module

    seen: list[tuple[float, float, float]] = []
    real = update_module.rl_loss

    def recording(lp, old, adv, mask, cfg, **kw):
        loss, metrics = real(lp, old, adv, mask, cfg, **kw)
        seqs = float((mask.sum(-1) > 0).sum())
        seen.append((float(loss.detach()), float(mask.sum()), seqs))
        return loss, metrics

    monkeypatch.setattr(update_module, "rl_loss", recording)
    return seen


@pytest.mark.parametrize(
    ("agg", "kl_coef"),
    [("token-mean", 0.0), ("token-mean", 0.1), ("seq-mean-token-mean", 0.0),
     ("seq-mean-token-sum", 0.1)],
)  # fmt: skip
def test_token_budget_micro_batches_leave_the_loss_and_gradient_unchanged(
    policy, agg, kl_coef, monkeypatch
):
    """The weighted sum of the token-budget micro-batches' losses is the whole batch's loss, and
    the gradient is the one of a single micro-batch of everything; every micro-batch run holds
    at most the budget (rows x width) unless it is one sample."""
    lengths = [9, 4, 7, 5, 8, 6, 4, 12]
    tensors = mixed_batch(lengths, advantages=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.5])
    loss = LossConfig(agg=agg, kl_coef=kl_coef)
    losses = record_losses(monkeypatch)
    whole, _ = run_update(policy, tensors, loss=loss, micro_batch_size=8)
    assert len(losses) == 1
    (whole_loss, _, _) = losses.pop()
    shapes: list[tuple[int, int]] = []
    budget, _ = run_update(
        policy, tensors, loss=loss, micro_batch_size=8, max_tokens=16, record=shapes
    )
    assert_same_grads(budget, whole)
    by_tokens = agg == "token-mean"
    total = sum(t if by_tokens else q for _, t, q in losses)
    summed = sum(lo * (t if by_tokens else q) / total for lo, t, q in losses)
    assert len(losses) > 1 and summed == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    update_shapes = shapes[-len(losses) :]  # a reference pass runs first with a KL term
    assert sum(r for r, _ in update_shapes) == len(lengths)
    assert all(r * w <= 16 or r == 1 for r, w in shapes)


def test_token_budget_logprob_pass_returns_rows_in_their_order(policy):
    tensors = mixed_batch([9, 4, 7, 5, 8, 6])
    args = (tensors.input_ids, tensors.attention_mask, tensors.response_mask)
    with torch.no_grad():
        fixed, fixed_ent = sequence_logprobs(policy, *args, micro_batch_size=6, with_entropy=True)
        packed, packed_ent = sequence_logprobs(
            policy, *args, micro_batch_size=6, with_entropy=True, max_tokens=14
        )
    torch.testing.assert_close(packed, fixed, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed_ent, fixed_ent, rtol=1e-5, atol=1e-6)


def test_a_rank_with_fewer_micro_batches_matches_the_others_and_its_gradient_holds(
    policy, monkeypatch
):
    """Another rank needs 6 micro-batches: this one splits its own and repeats a weightless
    filler, running exactly 6 forwards per pass, and its gradient is unchanged."""
    tensors = mixed_batch([5, 5, 6, 7])
    whole, _ = run_update(policy, tensors, micro_batch_size=4)
    monkeypatch.setattr(micro_module, "max_over_ranks", lambda n: max(n, 6))
    shapes: list[tuple[int, int]] = []
    got, metrics = run_update(policy, tensors, micro_batch_size=4, max_tokens=64, record=shapes)
    assert len(shapes) == 6 and sum(r for r, _ in shapes) == 6  # 4 rows + 2 fillers
    assert_same_grads(got, whole)
    assert metrics["trained_tokens"] == tensors.response_mask.sum().item()


def test_a_rank_with_only_gradient_free_rows_runs_weightless_fillers(policy, monkeypatch):
    tensors = mixed_batch([5, 6, 7], advantages=[0.0, 0.0, 0.0])
    import lorarl.trainer.update.actor as update_module

    monkeypatch.setattr(update_module, "max_over_ranks", lambda n: max(n, 2))
    micros = plan_micro_batches(tensors, torch.tensor([True, True, True]),
                                UpdateConfig(LossConfig(), 4, max_tokens=32))  # fmt: skip
    assert [(r.tolist(), w) for r, w in micros] == [([0], 0.0), ([0], 0.0)]
    grads, _ = run_update(policy, tensors, micro_batch_size=4, max_tokens=32)
    assert grads and all((g == 0).all() for g in grads.values())


def test_skipped_rows_stay_skipped_under_a_token_budget(policy):
    tensors = mixed_batch([5, 6, 7, 8], advantages=[0.0, 1.0, 0.0, -1.0])
    micros = plan_micro_batches(tensors, torch.tensor([True, False, True, False]),
                                UpdateConfig(LossConfig(), 4, max_tokens=10))  # fmt: skip
    assert [(r.tolist(), w) for r, w in micros] == [([1], 1.0), ([3], 1.0)]
    whole, _ = run_update(policy, tensors, micro_batch_size=4)
    got, _ = run_update(policy, tensors, micro_batch_size=4, max_tokens=10)
    assert_same_grads(got, whole)


def test_spec_token_budget_field_reaches_the_update_config():
    doc = copy.deepcopy(MINIMAL)
    doc["spec"]["training"] = {"maxTokensPerMicroBatch": 8192}
    job = LoRARLJob.model_validate(doc)
    assert job.spec.training.max_tokens_per_micro_batch == 8192
    from lorarl.trainer.update.policy import build_policy

    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    ctx = DistContext(0, 1, 0, torch.device("cpu"), None)
    assert build_policy(job, base, ctx).update_cfg.max_tokens == 8192
    doc["spec"]["algorithm"] = {"name": "ppo", "groupSize": 1}
    assert LoRARLJob.model_validate(doc).spec.training.max_tokens_per_micro_batch == 8192


def test_ppo_step_under_a_token_budget_is_the_same_step(tmp_path, monkeypatch):
    """PPO's old-logprob and value passes, its critic update and its actor update all cut by
    the budget: the critic's and the actor's gradients and the reported value loss are the
    ones of micro-batches by size; every forward holds at most the budget."""
    from harness.workloads.tiny_models import make_tiny_model
    from lorarl.trainer.model.critic import add_critic, critic_parameters
    from lorarl.trainer.update.ppo import PPOConfig, PPOUpdate
    from tests.integration import ppo_worker as W

    model_dir = make_tiny_model(tmp_path / "m", arch="llama")

    def step(max_tokens, shapes=None):
        from lorarl.trainer.model.critic import actor_parameters
        from lorarl.trainer.model.loading import apply_lora, load_base_model

        torch.manual_seed(0)
        model = apply_lora(load_base_model(model_dir), W.LORA)
        add_critic(model, W.CRITIC.lora)
        if shapes is not None:  # the decoder: every policy, reference and value pass runs it

            def record(_m, args, kwargs):
                ids = kwargs.get("input_ids")
                shapes.append(tuple((args[0] if ids is None else ids).shape))

            model.get_base_model().model.register_forward_pre_hook(record, with_kwargs=True)
        actor = [p for _, p in actor_parameters(model)]
        critic = [p for _, p in critic_parameters(model)]
        cfg = PPOConfig(1.0, 0.95, W.CRITIC)
        ucfg = UpdateConfig(LossConfig(), micro_batch_size=4, grad_clip=1e9, max_tokens=max_tokens)
        ppo = PPOUpdate(model, torch.optim.SGD(actor, lr=0.0), torch.optim.SGD(critic, lr=0.0),
                        ucfg, cfg, actor)  # fmt: skip
        metrics = ppo.update(collate(W.batch_samples(1), 0), step=5)
        return metrics, grads_of(model)

    by_size, want = step(None)
    shapes: list[tuple[int, ...]] = []
    budget, got = step(24, shapes)
    assert_same_grads(got, want)
    for key in ("value_loss", "critic_grad_norm", "grad_norm"):
        assert budget[key] == pytest.approx(by_size[key], rel=1e-4, abs=1e-7), key
    assert shapes and all(r * w <= 24 or r == 1 for r, w in shapes)
