"""Loss pieces against hand-computed values, including their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.trainer.rl.losses import (
    LossConfig,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    rl_loss,
    token_logprobs_from_logits,
)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0
    )


OLD = -1.0  # a realistic old logprob; new = OLD + log(ratio)


def new_from_ratios(ratios):
    return t([[OLD + math.log(r) for r in row] for row in ratios])


# ---------------------------------------------------------------- aggregate

LOSS = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # row 2 is micro-batch filler


@pytest.mark.parametrize(
    ("mode", "norm_len", "expected"),
    [
        ("token-mean", None, (1 + 2 + 3 + 4) / 4),  # 2.5
        ("seq-mean-token-mean", None, ((1 + 2 + 3) / 3 + 4 / 1) / 2),  # 3.0
        ("seq-mean-token-sum", None, ((1 + 2 + 3) + 4) / 2),  # 5.0
        ("seq-mean-token-sum", 4, ((1 + 2 + 3) / 4 + 4 / 4) / 2),  # 1.25
    ],
)
def test_aggregate_modes(mode, norm_len, expected):
    close(aggregate(LOSS, MASK, mode, norm_len=norm_len), expected)


def test_aggregate_all_masked_is_zero_and_differentiable():
    x = torch.ones(2, 3, requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        out = aggregate(x, torch.zeros(2, 3), mode)
        assert out.item() == 0.0
        out.backward()
        assert x.grad.abs().sum() == 0


def test_aggregate_rejects_bad_input():
    with pytest.raises(ValueError, match=r"unknown loss aggregation 'mean'.*token-mean"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="mask shape"):
        aggregate(LOSS, MASK[:, :2], "token-mean")
    with pytest.raises(ValueError, match="norm_len applies to 'seq-mean-token-sum' only"):
        aggregate(LOSS, MASK, "token-mean", norm_len=4)


# ---------------------------------------------------------------- policy loss


def test_policy_loss_by_hand():
    # clip 0.2 both sides, loss = max(-A r, -A clip(r, .8, 1.2)):
    #   A=+1 r=1.5: max(-1.5, -1.2) = -1.2  (clipped)
    #   A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    #   A=-1 r=0.5: max( 0.5,  0.8) =  0.8  (clipped)
    #   A=-1 r=1.1: max( 1.1,  1.1) =  1.1
    #   padding token (A=5, r=3) ignored
    # token-mean = (-1.2 - .5 + .8 + 1.1) / 4 = .05; clip_frac = 2/4
    ratios = [[1.5, 0.5, 0.5, 1.1, 3.0]]
    adv = t([[1.0, 1.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, m = policy_loss(new_from_ratios(ratios), torch.full((1, 5), OLD), adv, mask)
    close(loss, 0.05)
    close(m["clip_frac"], 0.5)
    close(m["ratio_mean"], (1.5 + 0.5 + 0.5 + 1.1) / 4)
    close(m["approx_kl"], -(math.log(1.5) + 2 * math.log(0.5) + math.log(1.1)) / 4)
    # seq-mean-token-mean over one sequence equals token-mean
    loss_seq, _ = policy_loss(
        new_from_ratios(ratios), torch.full((1, 5), OLD), adv, mask, agg="seq-mean-token-mean"
    )
    close(loss_seq, 0.05)


def test_clip_higher():
    # A=+1 r=1.25: symmetric clip caps at 1.2 -> loss -1.2 (clipped);
    # clip_high .28 allows up to 1.28 -> loss -1.25 (not clipped)
    lp, old = new_from_ratios([[1.25]]), t([[OLD]])
    adv, mask = t([[1.0]]), torch.ones(1, 1)
    sym, m_sym = policy_loss(lp, old, adv, mask)
    high, m_high = policy_loss(lp, old, adv, mask, clip_high=0.28)
    close(sym, -1.2)
    close(high, -1.25)
    assert (m_sym["clip_frac"].item(), m_high["clip_frac"].item()) == (1.0, 0.0)


def test_dual_clip_caps_negative_advantages():
    # c = 3:
    #   A=-1 r=5: max(5, 1.2) = 5 > cap 3 -> 3  (dual clip)
    #   A=-1 r=2: max(2, 1.2) = 2 < cap 3 -> 2
    #   A=+1 r=5: max(-5, -1.2) = -1.2 (ordinary clip; dual clip never touches A > 0)
    # token-mean = (3 + 2 - 1.2) / 3; clipped tokens: 1st (dual) and 3rd (ppo) -> 2/3
    lp = new_from_ratios([[5.0, 2.0, 5.0]])
    adv = t([[-1.0, -1.0, 1.0]])
    loss, m = policy_loss(lp, torch.full((1, 3), OLD), adv, torch.ones(1, 3), dual_clip=3.0)
    close(loss, 3.8 / 3)
    close(m["clip_frac"], 2 / 3)
    close(m["dual_clip_frac"], 1 / 3)
    plain, _ = policy_loss(lp, torch.full((1, 3), OLD), adv, torch.ones(1, 3))
    close(plain, (5 + 2 - 1.2) / 3)


def test_policy_gradient_zero_when_clipped_minus_a_over_n_otherwise():
    # five real tokens (N = 5) + one padding token, token-mean:
    #   on-policy (r=1) A=2 and A=-.5: d/dlogp (-A r)/N = -A r / N -> -2/5, +.5/5
    #   A=+1 r=.9 (inside the clip range): -r/N = -.9/5
    #   A=+1 r=1.5 and A=-1 r=.5: clipped -> gradient 0
    #   padding (A=3): 0
    ratios = [[1.0, 1.0, 0.9, 1.5, 0.5, 1.0]]
    adv = t([[2.0, -0.5, 1.0, 1.0, -1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    lp = new_from_ratios(ratios).requires_grad_()
    loss, m = policy_loss(lp, torch.full((1, 6), OLD), adv, mask)
    loss.backward()
    close(lp.grad, [[-2 / 5, 0.5 / 5, -0.9 / 5, 0.0, 0.0, 0.0]])
    close(m["clip_frac"], 2 / 5)


def test_policy_loss_with_huge_ratio_stays_finite():
    lp = t([[0.0, 0.0]]).requires_grad_()
    loss, _ = policy_loss(lp, t([[-80.0, -1.0]]), t([[-1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


def test_policy_loss_rejects_bad_input():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_low must be in"):
        policy_loss(x, x, x, x, clip_low=1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, x, x, x, dual_clip=1.0)
    with pytest.raises(ValueError, match="advantages_tok shape"):
        policy_loss(x, x, torch.zeros(1, 3), x)


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # token 0: logp -1, ref -2 -> diff 1;  token 1: logp -2, ref -1 -> diff -1
    # k1 = diff; k2 = diff^2 / 2; k3 = e^d - d - 1 with d = ref - logp:
    #   d = -1 -> e^-1 + 1 - 1 = e^-1;   d = 1 -> e - 2
    logp, ref = t([[-1.0, -2.0]]), t([[-2.0, -1.0]])
    close(kl_penalty(logp, ref, "k1"), [[1.0, -1.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.5, 0.5]])
    close(kl_penalty(logp, ref, "k3"), [[math.exp(-1), math.e - 2]])
    close(kl_penalty(logp, ref, "low_var_kl"), kl_penalty(logp, ref, "k3"))


def test_low_var_kl_is_clamped_and_finite():
    # d = 0 - (-30) = 30: e^30 - 31 would be ~1e13; verl clamps the estimate to 10
    out = kl_penalty(t([[-30.0, -1.0]]), t([[0.0, -1.0]]), "low_var_kl")
    assert out.tolist() == [[10.0, 0.0]]


def test_kl_rejects_unknown_estimator_and_shapes():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*k1, k2, k3, low_var_kl"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "k4")
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        kl_penalty(t([[0.0]]), t([[0.0, 1.0]]), "k1")


# ---------------------------------------------------------------- logits -> logprobs / entropy

# exp([0, ln 2, ln 5]) = [1, 2, 5], Z = 8 -> p = [1/8, 2/8, 5/8]
LOGITS = t([[[0.0, math.log(2), math.log(5)], [0.0, 0.0, 0.0]]])


def test_token_logprobs_by_hand():
    out = token_logprobs_from_logits(LOGITS, torch.tensor([[2, 1]]))
    close(out, [[math.log(5 / 8), math.log(1 / 3)]])
    # ignore index -> 0, the other position unaffected
    out = token_logprobs_from_logits(LOGITS, torch.tensor([[-100, 0]]))
    close(out, [[0.0, math.log(1 / 3)]])


def test_token_logprobs_chunked_bf16_matches_full_fp32_log_softmax():
    torch.manual_seed(0)
    logits = (torch.randn(3, 5, 11) * 4).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 11, (3, 5))
    out = token_logprobs_from_logits(logits, labels, chunk_rows=4)  # 15 rows -> 4 chunks
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[..., None])[..., 0]
    close(out.detach(), ref, tol=1e-5)
    out.sum().backward()  # gradient flows back to the bf16 logits
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_token_logprobs_rejects_bad_labels():
    with pytest.raises(ValueError, match="labels contain ids >= vocab size 3"):
        token_logprobs_from_logits(LOGITS, torch.tensor([[3, 0]]))
    with pytest.raises(ValueError, match="labels shape"):
        token_logprobs_from_logits(LOGITS, torch.tensor([[1, 0, 0]]))
    with pytest.raises(ValueError, match="integer token ids"):
        token_logprobs_from_logits(LOGITS, t([[1.0, 0.0]]))


def test_entropy_by_hand():
    # H = -(1/8 ln 1/8 + 2/8 ln 2/8 + 5/8 ln 5/8); uniform over 3 -> ln 3
    h0 = -(1 / 8 * math.log(1 / 8) + 2 / 8 * math.log(2 / 8) + 5 / 8 * math.log(5 / 8))
    close(entropy_from_logits(LOGITS, chunk_rows=1), [[h0, math.log(3)]])


def test_entropy_stable_with_large_and_masked_logits():
    # huge equal logits: naive exp overflows, logsumexp form gives ln 2;
    # a -inf (masked) entry contributes 0, not 0 * -inf = NaN, in value and gradient
    logits = t([[[1e4, 1e4, float("-inf")], [0.0, 0.0, float("-inf")]]]).requires_grad_()
    h = entropy_from_logits(logits)
    close(h.detach(), [[math.log(2), math.log(2)]])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ---------------------------------------------------------------- rl_loss


def test_rl_loss_assembles_terms():
    # on-policy (r = 1), A = [1, 0] -> policy = (-1 + 0) / 2 = -.5
    # k1 KL: diffs [-1 - -2, -1 - -1] = [1, 0] -> .5
    # entropy [2, 4] -> 3
    # total = -.5 + .1 * .5 - .01 * 3 = -.48
    lp = t([[-1.0, -1.0]])
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = rl_loss(
        lp,
        lp,
        t([[1.0, 0.0]]),
        torch.ones(1, 2),
        cfg,
        ref_logprobs=t([[-2.0, -1.0]]),
        entropy=t([[2.0, 4.0]]),
    )
    close(loss, -0.48)
    close(m["policy_loss"], -0.5)
    close(m["kl"], 0.5)
    close(m["entropy"], 3.0)
    close(m["loss"], -0.48)
    assert {"clip_frac", "approx_kl", "ratio_mean"} <= set(m)


def test_rl_loss_reports_kl_without_penalizing():
    lp = t([[-1.0, -1.0]])
    loss, m = rl_loss(
        lp,
        lp,
        t([[1.0, 0.0]]),
        torch.ones(1, 2),
        LossConfig(kl_estimator="k1"),
        ref_logprobs=t([[-2.0, -1.0]]),
    )
    close(loss, -0.5)
    close(m["kl"], 0.5)
    assert "entropy" not in m


def test_rl_loss_and_config_reject_bad_input():
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        rl_loss(lp, lp, lp, lp, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy_coef > 0 needs entropy"):
        rl_loss(lp, lp, lp, lp, LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="agg must be one of"):
        LossConfig(agg="sum")
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        LossConfig(kl_estimator="k9")
    with pytest.raises(ValueError, match="norm_len applies to agg 'seq-mean-token-sum' only"):
        LossConfig(norm_len=512)
    with pytest.raises(ValueError, match="clip_high must be >= 0"):
        LossConfig(clip_high=-0.1)


# ---------------------------------------------------------------- rollout correction (issue 13 #5)


def test_tis_caps_the_trainer_over_engine_ratio_and_weighs_the_token_loss():
    from lorarl.trainer.rl.losses import rollout_correction

    old = t([[-1.0, -1.0, -1.0, -1.0]])
    engine = old - t([[0.0, math.log(1.5), math.log(3.0), -math.log(4.0)]])  # rho 1, 1.5, 3, 1/4
    mask = t([[1.0, 1.0, 1.0, 1.0]])
    w, m = rollout_correction(old, engine, mask, "tis", 2.0)
    close(w, [[1.0, 1.5, 2.0, 0.25]])
    close(m["tis_clip_frac"], 0.25)
    w, m = rollout_correction(old, engine, mask, "mask-token", 2.0)
    close(w, [[1.0, 1.0, 0.0, 0.0]])
    close(m["tis_clip_frac"], 0.5)
    w, _ = rollout_correction(old, engine, mask, "mask-sequence", 2.0)  # geo-mean rho 1.06
    close(w, [[1.0, 1.0, 1.0, 1.0]])
    w, _ = rollout_correction(old, engine, t([[0.0, 0.0, 1.0, 0.0]]), "mask-sequence", 2.0)
    close(w, [[0.0, 0.0, 0.0, 0.0]])  # its only token has rho 3
    # In the loss: with advantage 1 and ratio 1 the per-token loss is -1, weighted by w.
    cfg = LossConfig(correction="tis", correction_threshold=2.0)
    loss, metrics = rl_loss(old.clone(), old, t([[1.0] * 4]), mask, cfg, rollout_logprobs=engine)
    close(loss, -(1.0 + 1.5 + 2.0 + 0.25) / 4)
    close(metrics["tis_clip_frac"], 0.25)
    plain, _ = rl_loss(old.clone(), old, t([[1.0] * 4]), mask, LossConfig(correction="off"))
    close(plain, -1.0)


def test_mse_is_k2_and_low_var_kl_is_k3():
    lp, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    close(kl_penalty(lp, ref, "mse"), kl_penalty(lp, ref, "k2"))
    close(kl_penalty(lp, ref, "low_var_kl"), kl_penalty(lp, ref, "k3"))


def test_seq_mean_token_sum_norm_divides_by_a_constant_length():
    loss = aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=10)
    close(loss, aggregate(LOSS, MASK, "seq-mean-token-sum", norm_len=10))
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_value_gradient_and_entropy_match_log_softmax(temperature, dtype):
    from lorarl.trainer.rl.losses import chunked_logprobs

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5, 11, generator=g) * 3).to(dtype)
    logits[0, 1, 4] = float("-inf")  # a masked vocabulary entry
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[2, 4] = -100
    weights = torch.randn(3, 5, generator=g)
    a = logits.clone().requires_grad_(True)
    lp, ent = chunked_logprobs(a, labels, temperature=temperature, chunk_rows=4, with_entropy=True)
    (lp * weights).sum().backward()
    b = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(b.float() / temperature, -1)
    want = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(labels < 0, 0.0)
    (want * weights).sum().backward()
    torch.testing.assert_close(lp, want.detach(), rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)
    assert a.grad.dtype == dtype and torch.isfinite(a.grad).all()
    h = -(logp.exp() * logp.masked_fill(logp == float("-inf"), 0.0)).sum(-1)
    torch.testing.assert_close(ent, h.detach(), rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
