"""The update equals the loss of the whole batch aggregated once, however it is split."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import tiny_config
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.rl.losses import LossConfig
from lorarl.trainer.rl.samples import TrainSample
from lorarl.trainer.update.actor import UpdateConfig, update_policy
from lorarl.trainer.update.batch import collate
from lorarl.trainer.update.state import lr_at


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


def batch():
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(6):
        p, c = 3 + i % 2, 2 + i % 3
        ids = torch.randint(4, 100, (p + c,), generator=g).tolist()
        samples.append(TrainSample(ids[:p], ids[p:], [-4.0] * c, float(i % 3 - 1), 0.0, 0))
    return collate(samples, pad_id=0)


def grads_after_update(policy, micro: int, agg: str) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(policy)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    cfg = UpdateConfig(LossConfig(agg=agg), micro_batch_size=micro, grad_clip=1e9)
    metrics = update_policy(model, opt, batch(), cfg)
    assert math.isfinite(metrics["loss"]) and metrics["trained_tokens"] > 0
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_does_not_change_the_gradient(policy, agg):
    whole = grads_after_update(policy, micro=6, agg=agg)
    split = grads_after_update(policy, micro=2, agg=agg)
    uneven = grads_after_update(policy, micro=4, agg=agg)
    assert whole and set(whole) == set(split)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(uneven[name], whole[name], rtol=1e-4, atol=1e-7)


def test_update_moves_only_lora_and_reports_metrics(policy):
    model = copy.deepcopy(policy)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = UpdateConfig(LossConfig(kl_coef=0.1), micro_batch_size=3)
    metrics = update_policy(model, opt, batch(), cfg)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert {"loss", "kl", "entropy", "clip_frac", "grad_norm", "logprob_mismatch"} <= set(metrics)
    # B is non-zero, so the policy already differs from the base (adapter disabled)
    assert metrics["kl"] != 0.0


def test_multiple_mini_batches_take_several_optimizer_steps(policy):
    model = copy.deepcopy(policy)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    update_policy(model, opt, batch(), UpdateConfig(LossConfig(), micro_batch_size=2,
                                                    mini_batches=3, epochs=2))  # fmt: skip
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {6}  # 3 mini-batches x 2 epochs


def test_lr_schedule():
    assert lr_at(1, 1e-3, warmup=4, total=10, schedule="constant") == pytest.approx(2.5e-4)
    assert lr_at(4, 1e-3, warmup=4, total=10, schedule="constant") == pytest.approx(1e-3)
    assert lr_at(9, 1e-3, warmup=4, total=10, schedule="constant") == pytest.approx(1e-3)
    assert lr_at(4, 1e-3, warmup=4, total=10, schedule="cosine") == pytest.approx(1e-3)
    assert lr_at(7, 1e-3, warmup=4, total=10, schedule="cosine") == pytest.approx(5e-4)
    assert lr_at(10, 1e-3, warmup=4, total=10, schedule="cosine") == pytest.approx(0.0, abs=1e-12)


def _update(policy, tensors, **cfg) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(policy)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    config = UpdateConfig(LossConfig(), micro_batch_size=3, grad_clip=1e9, **cfg)
    metrics = update_policy(model, opt, tensors, config)
    return metrics, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_off_policy_ratio_is_against_the_engines_logprobs(policy):
    """One-step off-policy samples: the ratio's denominator is the policy that generated them."""
    tensors = batch()
    with torch.no_grad():
        own, _ = sequence_logprobs(
            policy, tensors.input_ids, tensors.attention_mask, tensors.response_mask,
            micro_batch_size=6,
        )  # fmt: skip
    on_metrics, on_grads = _update(policy, tensors)
    # the engines served exactly the trainer's weights: the same update as on-policy
    tensors.rollout_logprobs = own.clone()
    same_metrics, same_grads = _update(policy, tensors, behavior_from_rollout=True)
    for name in on_grads:
        torch.testing.assert_close(same_grads[name], on_grads[name], rtol=1e-4, atol=1e-7)
    assert same_metrics["clip_frac"] == on_metrics["clip_frac"] == 0.0
    # older weights gave every token e^-1 of today's probability: ratio e > 1 + clip, clipped
    tensors.rollout_logprobs = torch.where(tensors.response_mask.bool(), own - 1.0, 0.0)
    stale_metrics, stale_grads = _update(policy, tensors, behavior_from_rollout=True)
    assert stale_metrics["clip_frac"] > 0.3
    assert any(not torch.allclose(stale_grads[n], on_grads[n]) for n in on_grads)


def _dropout_policy(dropout: float):
    from lorarl.trainer.model.loading import LoraSettings, apply_lora

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama", init_std=0.1))
    model = apply_lora(base, LoraSettings(rank=8, alpha=16, dropout=dropout))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.train()  # what a caller may leave it in: dropout must stay off regardless


@pytest.mark.parametrize("dropout", [0.05, 0.1])
def test_lora_dropout_never_makes_the_ratio_drift_at_lr_zero(dropout):
    """Issue 13 #1: with dropout on, old-logprob and update passes drew different masks
    (clip_frac 0.10 / 0.17 at lr 0 here); the engine samples without dropout."""
    model = _dropout_policy(dropout)
    b = batch()
    with torch.no_grad():
        first, _ = sequence_logprobs(model, b.input_ids, b.attention_mask, b.response_mask,
                                     micro_batch_size=6)  # fmt: skip
        again, _ = sequence_logprobs(model, b.input_ids, b.attention_mask, b.response_mask,
                                     micro_batch_size=6)  # fmt: skip
    assert torch.equal(first, again)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0)
    cfg = UpdateConfig(LossConfig(), micro_batch_size=2, mini_batches=3, epochs=2)
    metrics = update_policy(model, opt, b, cfg)
    assert metrics["clip_frac"] == 0.0 and metrics["clip_frac_first_update"] == 0.0
    # The configured value still travels with the adapter (for a later supervised fine-tune).
    assert model.peft_config["default"].lora_dropout == dropout


def _scaled_rollout_batch(model, temperature: float):
    """Samples whose engine logprobs are those of softmax(z / T) under `model` (what both
    engines report as lorarl starts them)."""
    from lorarl.trainer.update.batch import collate as _collate

    b = batch()
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, b.input_ids, b.attention_mask, b.response_mask,
                                  micro_batch_size=6, temperature=temperature)  # fmt: skip
    samples = []
    for i in range(len(b)):
        resp = b.response_mask[i].bool()
        ids = b.input_ids[i][b.attention_mask[i].bool()].tolist()
        n = int(resp.sum())
        samples.append(TrainSample(ids[: len(ids) - n], ids[len(ids) - n :], lp[i][resp].tolist(),
                                   float(i % 3 - 1), 0.0, 0))  # fmt: skip
    return _collate(samples, pad_id=0)


def test_the_trainer_scores_the_temperature_the_engines_sampled_at(policy):
    """Issue 13 #2: at identical weights, engine logprobs at T=0.7 vs a trainer scoring T=1
    clipped tokens with `offPolicySteps: 1`; scoring softmax(z / T) gives ratio 1 exactly."""
    model = copy.deepcopy(policy)
    b = _scaled_rollout_batch(model, 0.7)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    cfg = UpdateConfig(LossConfig(), micro_batch_size=3, behavior_from_rollout=True,
                       temperature=0.7)  # fmt: skip
    metrics = update_policy(model, opt, b, cfg)
    assert metrics["clip_frac"] == 0.0
    assert metrics["logprob_mismatch"] < 1e-6
    unscaled = update_policy(model, opt, b, UpdateConfig(LossConfig(), micro_batch_size=3,
                                                         behavior_from_rollout=True))  # fmt: skip
    assert unscaled["logprob_mismatch"] > 1e-2  # the test can tell T=1 from T=0.7


def test_reference_logprobs_use_the_sampling_temperature(policy):
    from lorarl.trainer.model.logprobs import reference_logprobs

    b = batch()
    with torch.no_grad(), policy.disable_adapter():
        logits = policy(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
    want = torch.log_softmax(logits[:, :-1] / 0.5, -1).gather(-1, b.input_ids[:, 1:, None])[..., 0]
    ref = reference_logprobs(policy, b.input_ids, b.attention_mask, b.response_mask,
                             micro_batch_size=6, temperature=0.5)  # fmt: skip
    mask = b.response_mask[:, 1:].bool()
    torch.testing.assert_close(ref[:, 1:][mask], want[mask], rtol=1e-5, atol=1e-5)


def test_truncated_importance_sampling_against_the_engine_is_reported_per_step(policy):
    """Issue 13 #5: tokens the engine found much less likely than the trainer (rho > 2) are
    capped; the step reports how many, and the mismatch quantiles."""
    model = copy.deepcopy(policy)
    b = _scaled_rollout_batch(model, 1.0)
    mask = b.response_mask.bool()
    b.rollout_logprobs[:3] = torch.where(mask[:3], b.rollout_logprobs[:3] - 2.0, 0.0)  # rho e^2
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    tis = UpdateConfig(LossConfig(correction="tis"), micro_batch_size=3)
    metrics = update_policy(model, opt, b, tis)
    share = float(mask[:3].sum() / mask.sum())
    assert metrics["tis_clip_frac"] == pytest.approx(share)
    # half the tokens or more match up to float32 noise (recomputed at another batch shape: up
    # to ~2e-6 on an AVX2-only CPU)
    assert metrics["logprob_mismatch_p50"] <= 1e-5
    assert 2.0 <= metrics["logprob_mismatch_p99"] <= 10**0.5  # the shifted ones, binned
    off = update_policy(model, opt, b, UpdateConfig(LossConfig(), micro_batch_size=3))
    assert "tis_clip_frac" not in off


def test_mismatch_compares_engine_and_trainer_at_the_same_weights(policy):
    """With two mini-batches the second one trains on a moved policy; the engine-vs-trainer
    mismatch must still be measured against the weights that generated the samples."""
    model = copy.deepcopy(policy)
    b = _scaled_rollout_batch(model, 0.7)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = UpdateConfig(LossConfig(correction="tis"), micro_batch_size=3, mini_batches=2,
                       temperature=0.7)  # fmt: skip
    metrics = update_policy(model, opt, b, cfg)
    assert metrics["clip_frac"] > 0  # the policy did move between the mini-batches...
    assert metrics["logprob_mismatch"] < 1e-6  # ...but not between the engine and the trainer
    assert metrics["tis_clip_frac"] == 0.0


def test_kl_reference_can_be_the_frozen_initial_adapter(policy):
    """Issue 13 #12: starting from an adapter, the KL reference may be that adapter (kept frozen
    on the same base) instead of the raw base."""
    from lorarl.trainer.model.logprobs import (
        adapter_reference_logprobs,
        reference_logprobs,
        snapshot_lora,
    )

    model = copy.deepcopy(policy)
    b = batch()
    args = (b.input_ids, b.attention_mask, b.response_mask)
    initial = snapshot_lora(model)
    with torch.no_grad():
        want, _ = sequence_logprobs(model, *args, micro_batch_size=6, temperature=0.7)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    update_policy(model, opt, b, UpdateConfig(LossConfig(), micro_batch_size=3))  # it moves
    trained = snapshot_lora(model)
    got = adapter_reference_logprobs(model, initial, *args, micro_batch_size=6, temperature=0.7)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters() if n in trained)
    base = reference_logprobs(model, *args, micro_batch_size=6, temperature=0.7)
    assert (base - want).abs().max() > 1e-3  # the initial adapter is not the base
    cfg = UpdateConfig(LossConfig(kl_coef=0.1), micro_batch_size=3)
    kl_initial = update_policy(copy.deepcopy(model), opt, b, cfg, reference=initial)["kl"]
    kl_base = update_policy(copy.deepcopy(model), opt, b, cfg)["kl"]
    assert kl_initial != kl_base


def _mixed_length_batch(lengths: list[int]):
    g = torch.Generator().manual_seed(3)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(4, 100, (n,), generator=g).tolist()
        c = n - 3
        lps = [-1.0 - 0.1 * i] * c  # a different engine logprob per sample
        samples.append(TrainSample(ids[:3], ids[3:], lps, float(i % 3 - 1), 0.0, 0))
    return collate(samples, pad_id=0)


def test_micro_batches_hold_samples_of_one_length_and_run_only_their_width(policy):
    """Short and long samples alternate; each micro-batch gets one kind and the model sees only
    its columns: a micro-batch costs its longest sample, so this is the padding not computed."""
    widths: list[int] = []
    model = copy.deepcopy(policy)
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True
    )
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    try:
        update_policy(model, opt, _mixed_length_batch([5, 12, 5, 12]),
                      UpdateConfig(LossConfig(), micro_batch_size=2))  # fmt: skip
    finally:
        hook.remove()
    assert widths == [5, 12]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_reordered_micro_batches_keep_each_samples_own_old_and_reference_logprobs(policy, kl_coef):
    """The samples are reordered by length inside a mini-batch; their engine logprobs (the
    ratio's denominator here), reference logprobs and advantages must follow them, or the
    gradient differs from the one computed in a single micro-batch."""
    tensors = _mixed_length_batch([9, 4, 7, 5, 8, 6])

    def grads(micro: int) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(policy)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        cfg = UpdateConfig(LossConfig(kl_coef=kl_coef), micro_batch_size=micro, grad_clip=1e9,
                           behavior_from_rollout=True)  # fmt: skip
        update_policy(model, opt, tensors, cfg)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, split = grads(6), grads(2)
    assert whole and set(whole) == set(split)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7)


def test_scoring_a_micro_batch_at_its_own_width_changes_no_logprob(policy):
    from lorarl.trainer.model.logprobs import used_width

    tensors = _mixed_length_batch([4, 11, 6])
    assert used_width(tensors.attention_mask[:1], tensors.response_mask[:1]) == 4
    assert used_width(tensors.attention_mask, tensors.response_mask) == 11
    with torch.no_grad():
        together, _ = sequence_logprobs(policy, tensors.input_ids, tensors.attention_mask,
                                        tensors.response_mask, micro_batch_size=3)  # fmt: skip
        alone, _ = sequence_logprobs(policy, tensors.input_ids, tensors.attention_mask,
                                     tensors.response_mask, micro_batch_size=1)  # fmt: skip
    assert alone.shape == together.shape == tensors.input_ids.shape
    assert (alone[0, 4:] == 0).all()  # the trimmed columns come back as zeros
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-6)


def _grouped_batch(advantages: list[float]):
    g = torch.Generator().manual_seed(5)
    samples = []
    for i, adv in enumerate(advantages):
        n = 5 + i % 4
        ids = torch.randint(4, 100, (n,), generator=g).tolist()
        samples.append(TrainSample(ids[:3], ids[3:], [-1.0] * (n - 3), adv, 0.0, 0))
    return collate(samples, pad_id=0)


def _update_seeing_rows(policy, tensors, cfg, *, skipping: bool, monkeypatch):
    import lorarl.trainer.update.actor as update_module

    if not skipping:
        monkeypatch.setattr(update_module, "gradient_free", lambda batch, cfg: None)
    rows: list[int] = []
    model = copy.deepcopy(policy)
    hook = model.get_base_model().model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    try:
        metrics = update_policy(model, opt, tensors, cfg)
    finally:
        hook.remove()
        monkeypatch.undo()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return rows, grads, params, metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_samples_without_advantage_are_not_run_and_the_update_is_the_same(policy, agg, monkeypatch):
    """Two GRPO groups of 4 had equal rewards (advantage 0): with no KL or entropy term they
    add nothing to the gradient, so they are not run; the denominators still count them."""
    tensors = _grouped_batch([0.0] * 4 + [1.0, -1.0, 0.5, -0.5] + [0.0] * 4)
    cfg = UpdateConfig(LossConfig(agg=agg), micro_batch_size=2)
    seen, grads, params, metrics = _update_seeing_rows(
        policy, tensors, cfg, skipping=True, monkeypatch=monkeypatch
    )
    all_seen, all_grads, all_params, _ = _update_seeing_rows(
        policy, tensors, cfg, skipping=False, monkeypatch=monkeypatch
    )
    assert sum(seen) == 4 and sum(all_seen) == 12
    for name in all_grads:
        torch.testing.assert_close(grads[name], all_grads[name], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(params[name], all_params[name], rtol=1e-4, atol=1e-6)
    assert metrics["trained_tokens"] == tensors.response_mask.sum().item()  # skipped ones too


def test_a_batch_with_no_advantage_anywhere_still_runs_one_micro_batch(policy, monkeypatch):
    tensors = _grouped_batch([0.0] * 6)
    cfg = UpdateConfig(LossConfig(), micro_batch_size=2)
    seen, grads, params, _ = _update_seeing_rows(
        policy, tensors, cfg, skipping=True, monkeypatch=monkeypatch
    )
    _, _, all_params, _ = _update_seeing_rows(
        policy, tensors, cfg, skipping=False, monkeypatch=monkeypatch
    )
    assert seen == [1]  # the shortest sample: every rank takes part in the same collectives
    assert grads and all((g == 0).all() for g in grads.values())
    for name in all_params:
        torch.testing.assert_close(params[name], all_params[name])


def test_with_a_kl_or_entropy_term_every_sample_is_run(policy, monkeypatch):
    from lorarl.trainer.update.actor import gradient_free

    tensors = _grouped_batch([0.0] * 4 + [1.0, -1.0, 0.5, -0.5])
    assert gradient_free(tensors, UpdateConfig(LossConfig(kl_coef=0.1), 2)) is None
    assert gradient_free(tensors, UpdateConfig(LossConfig(entropy_coef=0.01), 2)) is None
    skip = gradient_free(tensors, UpdateConfig(LossConfig(), 2))
    assert skip.tolist() == [True] * 4 + [False] * 4


# ------------------------------------------- no full-vocabulary fp32 tensor (issue 35 #6)


class _Fp32VocabTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for each fp32 tensor over the vocabulary (last dim) that got memory of its own,
    how many positions' worth of vocabulary rows it holds. Views share their base's memory and
    the parameters' memory exists before: neither counts."""

    def __init__(self, vocab: int, params):
        super().__init__()
        self.vocab, self.rows = vocab, []
        self.seen = {p.untyped_storage().data_ptr() for p in params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() < 2:
                continue
            storage = t.untyped_storage()
            if t.shape[-1] == self.vocab and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                self.rows.append(storage.nbytes() // (4 * self.vocab))
        return out


def _logit_rows_seen(monkeypatch, entropy_coef: float) -> tuple[int, list[int]]:
    """(positions the LM head scored, rows of every other new fp32 vocabulary tensor)."""
    from lorarl.trainer.model import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ROWS", 4, raising=False)
    config = tiny_config("llama", init_std=0.1)
    config.vocab_size = 301  # no other dimension of the model is 301
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    cfg = UpdateConfig(LossConfig(entropy_coef=entropy_coef), micro_batch_size=6)
    with _Fp32VocabTensors(config.vocab_size, model.parameters()) as seen:
        metrics = update_policy(model, opt, batch(), cfg)
    assert metrics["entropy"] > 0  # the entropy is still reported
    # the LM head's output and its gradient: the largest ones, one row per scored position
    head = max(seen.rows)
    return head, [r for r in seen.rows if r != head]


def test_without_an_entropy_term_no_full_vocabulary_fp32_tensor_is_built(monkeypatch):
    head, others = _logit_rows_seen(monkeypatch, entropy_coef=0.0)
    chunk = 4
    assert head > 4 * chunk  # the batch is many chunks long, so the check below means something
    # every other fp32 tensor over the vocabulary is one chunk: no [B, T, V] log-softmax, no
    # entropy graph (exp, products) over the whole batch
    assert others and max(others) <= chunk, sorted(others)


def test_with_an_entropy_term_its_gradient_is_the_full_one(policy):
    """The entropy bonus still trains: its gradient equals the one from an explicit full
    log-softmax entropy."""
    from lorarl.trainer.model.logprobs import sequence_logprobs

    b = batch()
    model = copy.deepcopy(policy)
    params = [p for p in model.parameters() if p.requires_grad]
    _, ent = sequence_logprobs(
        model, b.input_ids, b.attention_mask, b.response_mask,
        micro_batch_size=6, with_entropy=True, entropy_grad=True,
    )  # fmt: skip
    got = torch.autograd.grad(ent.sum(), params)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1)
    full = -(logp.exp() * logp).sum(-1)
    want = torch.autograd.grad((full * b.response_mask[:, 1:]).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    _, metric = sequence_logprobs(model, b.input_ids, b.attention_mask, b.response_mask,
                                  micro_batch_size=6, with_entropy=True)  # fmt: skip
    assert not metric.requires_grad
    torch.testing.assert_close(metric, ent.detach(), rtol=1e-5, atol=1e-6)


def test_the_mismatch_is_measured_per_replica_and_a_stale_one_stands_out(policy):
    """Samples of three engines: two report the trainer's own logprobs, the third's are 0.3
    nats off on every token (an engine on other weights). The update's per-engine gap names the
    third alone, numbered by the whole batch's endpoints whatever the rows' order."""
    from lorarl.trainer.update.batch import replica_index

    model = copy.deepcopy(policy)
    exact = _scaled_rollout_batch(model, 1.0)
    urls = ["http://c:1", "http://a:1", "http://b:1"]
    samples = []
    for i in range(len(exact)):
        resp = exact.response_mask[i].bool()
        ids = exact.input_ids[i][exact.attention_mask[i].bool()].tolist()
        n = int(resp.sum())
        url = urls[i % 3]
        lps = [v + (0.3 if url == "http://c:1" else 0.0) for v in exact.rollout_logprobs[i][resp]]
        advantage = 1.0 if i % 2 else -1.0  # none zero: a sample without one is not run
        samples.append(TrainSample(ids[: len(ids) - n], ids[len(ids) - n :], lps,
                                   advantage, 0.0, 0, endpoint=url))  # fmt: skip
    endpoints = replica_index(samples)
    assert endpoints == ["http://a:1", "http://b:1", "http://c:1"]
    b = collate(samples, pad_id=0, endpoints=endpoints)
    assert b.replicas.tolist() == [2, 0, 1, 2, 0, 1]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    metrics = update_policy(model, opt, b, UpdateConfig(LossConfig(), micro_batch_size=4),
                            replicas=len(endpoints))  # fmt: skip
    assert metrics["replica_mismatch/0"] < 1e-5 and metrics["replica_mismatch/1"] < 1e-5
    assert metrics["replica_mismatch/2"] == pytest.approx(0.3, abs=1e-4)
    # without `replicas` nothing per engine is reported (and nothing else changes)
    plain = update_policy(
        copy.deepcopy(policy), opt, b, UpdateConfig(LossConfig(), micro_batch_size=4)
    )
    assert not any(k.startswith("replica_mismatch/") for k in plain)
