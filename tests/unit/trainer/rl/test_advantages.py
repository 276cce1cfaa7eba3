"""Advantage estimators against values worked out by hand in each test."""

from __future__ import annotations

import math

import pytest
import torch

from lorarl.trainer.rl.advantages import (
    compute_advantages,
    explained_variance,
    gae,
    grpo_advantages,
    last_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    to_token_advantages,
    value_loss,
    whiten,
)


def t(*rows):
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


def close(actual, expected, tol=1e-5):
    torch.testing.assert_close(
        actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0
    )


# ---------------------------------------------------------------- GRPO / Dr.GRPO


def test_grpo_group_of_two():
    # groups [1,0] and [0,1]: mean 0.5, unbiased std = sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    s = math.sqrt(0.5)
    a = 0.5 / (s + 1e-6)
    close(grpo_advantages(t([1, 0, 0, 1]), 2), [a, -a, -a, a])


def test_grpo_group_of_four_exact():
    # [1,0,0,0]: mean 0.25, deviations [.75,-.25,-.25,-.25],
    # unbiased var = (.5625 + 3 * .0625) / 3 = .25 -> std .5 -> [1.5, -.5, -.5, -.5]
    # [2,2,0,0]: mean 1, deviations [1,1,-1,-1], var = 4/3 -> std 1.1547
    s2 = math.sqrt(4 / 3)
    adv = grpo_advantages(t([1, 0, 0, 0, 2, 2, 0, 0]), 4, eps=0.0)
    close(adv, [1.5, -0.5, -0.5, -0.5, 1 / s2, 1 / s2, -1 / s2, -1 / s2])


def test_dr_grpo_only_centers():
    # no std division: [1,0,0,0] -> [.75,-.25,-.25,-.25]; [4,0] -> [2,-2]
    adv = grpo_advantages(t([1, 0, 0, 0]), 4, scale_by_std=False)
    close(adv, [0.75, -0.25, -0.25, -0.25])
    close(grpo_advantages(t([4, 0]), 2, scale_by_std=False), [2.0, -2.0])


def test_equal_rewards_give_exact_zero_not_nan():
    # 0.9 is not representable: the float32 mean of [.9,.9,.9] differs from .9 by rounding, and
    # that noise divided by (std + eps) is ~0.056 per sample without the constant-group rule.
    g = t([0.9, 0.9, 0.9])
    assert (g - g.mean()).abs().max() > 0  # the premise: rounding really happens here
    rewards = t([0.9, 0.9, 0.9, 1.0, 0.0, 0.0])
    for adv in (
        grpo_advantages(rewards, 3),
        grpo_advantages(rewards, 3, scale_by_std=False),
        rloo_advantages(rewards, 3),
    ):
        assert torch.isfinite(adv).all()
        assert adv[:3].tolist() == [0.0, 0.0, 0.0]
        assert adv[3] > 0 and adv[4] < 0
    assert grpo_advantages(t([1, 1, 1, 1]), 2).tolist() == [0.0] * 4


def test_int_rewards_are_accepted():
    adv = grpo_advantages(torch.tensor([1, 0]), 2, scale_by_std=False)
    assert adv.dtype == torch.float32
    close(adv, [0.5, -0.5])


@pytest.mark.parametrize(
    ("rewards", "group_size", "match"),
    [
        (t([1, 0, 1, 0, 1]), 2, "group_size 2 does not divide the batch of 5"),
        (t([1, 0]), 1, "group_size must be >= 2"),
        (t([[1, 0]]), 2, "rewards must be 1-D"),
        (t([1, float("nan"), 0, 1]), 2, r"NaN/inf at indices \[1\]"),
        (torch.zeros(0), 2, "rewards is empty"),
    ],
)
def test_grpo_and_rloo_reject_bad_input(rewards, group_size, match):
    with pytest.raises(ValueError, match=match):
        grpo_advantages(rewards, group_size)
    with pytest.raises(ValueError, match=match):
        rloo_advantages(rewards, group_size)


def test_group_size_must_be_int():
    with pytest.raises(TypeError, match="group_size must be an int"):
        grpo_advantages(t([1, 0]), 2.0)


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out():
    # [1,0,0,0]: A_0 = 1 - (0+0+0)/3 = 1; A_j = 0 - (1+0+0)/3 = -1/3
    # [3,1]: A_0 = 3 - 1 = 2; A_1 = 1 - 3 = -2
    adv = rloo_advantages(t([1, 0, 0, 0, 3, 1, 1, 1]), 4)
    close(adv[:4], [1.0, -1 / 3, -1 / 3, -1 / 3])
    close(rloo_advantages(t([3, 1]), 2), [2.0, -2.0])
    # last group [3,1,1,1]: 3 - 1 = 2; 1 - (3+1+1)/3 = -2/3
    close(adv[4:], [2.0, -2 / 3, -2 / 3, -2 / 3])


# ---------------------------------------------------------------- REINFORCE++


def ones(n):
    return torch.ones(n, dtype=torch.long)


def test_reinforce_pp_whole_batch():
    # [1,0,3,3], one token each: mean 1.75, deviations [-.75,-1.75,1.25,1.25],
    # unbiased var = (.5625 + 3.0625 + 1.5625 + 1.5625) / 3 = 2.25 -> std 1.5
    adv = reinforce_pp_advantages(t([1, 0, 3, 3]), token_counts=ones(4), eps=0.0)
    close(adv, [-0.5, -1.75 / 1.5, 1.25 / 1.5, 1.25 / 1.5])


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    # groups [1,0], [3,3] -> centered [.5,-.5,0,0]; batch mean 0,
    # unbiased var = (.25 + .25) / 3 = 1/6 -> std .40825 -> [1.2247, -1.2247, 0, 0]
    s = math.sqrt(1 / 6)
    adv = reinforce_pp_advantages(t([1, 0, 3, 3]), 2, token_counts=ones(4), eps=0.0)
    close(adv, [0.5 / s, -0.5 / s, 0.0, 0.0])


def test_reinforce_pp_degenerate_batches_are_zero():
    assert reinforce_pp_advantages(t([2, 2, 2]), token_counts=[3, 1, 2]).tolist() == [0.0] * 3
    assert reinforce_pp_advantages(t([5.0]), token_counts=[7]).tolist() == [0.0]
    assert reinforce_pp_advantages(t([5.0, 1.0]), token_counts=[1, 0]).tolist() == [0.0, 0.0]
    # every group constant: centered values are all zero -> zero, not 0/eps noise
    zeros = reinforce_pp_advantages(t([0.9] * 3 + [0.7] * 3), 3, token_counts=ones(6))
    assert zeros.tolist() == [0.0] * 6


def _per_token_whitened(rewards, counts):
    """Each reward repeated on its sample's tokens, whitened with `whiten` over all of them."""
    width = max(counts)
    values = torch.zeros(len(counts), width)
    mask = torch.zeros(len(counts), width, dtype=torch.long)
    for i, (r, n) in enumerate(zip(rewards, counts, strict=True)):
        values[i, :n], mask[i, :n] = r, 1
    w = whiten(values, mask)
    return torch.stack([w[i, 0] if n else torch.tensor(0.0) for i, n in enumerate(counts)])


def test_reinforce_pp_whitens_over_tokens_not_sequences():
    # one short right answer type (2 tokens) and one long wrong one (200 tokens): the token mean
    # sits near the wrong answers, so the right ones get a large advantage and the wrong ones a
    # small negative one (verl, OpenRLHF). Per sequence it would be symmetric, +-0.87.
    r, counts = [1.0, 0.0, 0.0, 1.0], [2, 200, 200, 2]
    adv = compute_advantages("reinforce_pp", t(r), 1, token_counts=counts)
    close(adv, _per_token_whitened(r, counts))
    assert adv[0] > 7 and -0.1 < adv[1] < 0
    assert adv[0] == adv[3] and adv[1] == adv[2]


def test_reinforce_pp_baseline_whitens_over_tokens():
    r, counts = [1.0, 0.0, 0.5, 0.5, 1.0, 1.0], [3, 40, 5, 9, 1, 30]
    adv = compute_advantages("reinforce_pp_baseline", t(r), 2, token_counts=counts)
    centred = [0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    close(adv, _per_token_whitened(centred, counts))
    # constant groups are centred to 0 and then shifted by the batch's token mean, as in verl
    assert adv[2] != 0 and adv[2] == adv[3] == adv[4] == adv[5]


def test_reinforce_pp_needs_token_counts():
    with pytest.raises(ValueError, match="token_counts"):
        compute_advantages("reinforce_pp", t([1, 0]), 1)
    with pytest.raises(ValueError, match="token_counts must be"):
        reinforce_pp_advantages(t([1, 0]), token_counts=[1, 2, 3])


# ---------------------------------------------------------------- dispatch


def test_compute_advantages_dispatch():
    r = t([1, 0, 0, 0, 0.5, 0.5, 1, 0])
    close(compute_advantages("grpo", r, 4), grpo_advantages(r, 4))
    close(compute_advantages("dapo", r, 4), grpo_advantages(r, 4))
    close(compute_advantages("grpo", r, 4, eps=0.5), grpo_advantages(r, 4, eps=0.5))
    close(compute_advantages("dr_grpo", r, 4), grpo_advantages(r, 4, scale_by_std=False))
    close(compute_advantages("rloo", r, 4), rloo_advantages(r, 4))
    n = [3, 1, 4, 1, 5, 9, 2, 6]
    close(
        compute_advantages("reinforce_pp", r, 4, token_counts=n),
        reinforce_pp_advantages(r, token_counts=n),
    )
    close(
        compute_advantages("reinforce_pp_baseline", r, 4, token_counts=n),
        reinforce_pp_advantages(r, 4, token_counts=n),
    )
    # the estimators really differ on this batch, so the checks above can tell them apart
    assert not torch.allclose(grpo_advantages(r, 4), rloo_advantages(r, 4))


def test_compute_advantages_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gpro'.*dapo.*grpo.*rloo"):
        compute_advantages("gpro", t([1, 0]), 2)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo2'.*ppo.*gae\(\)"):
        compute_advantages("ppo2", t([1, 0]), 2)


def test_compute_advantages_rejects_unused_option():
    with pytest.raises(ValueError, match=r"options \['eps'\] are not used by 'rloo'"):
        compute_advantages("rloo", t([1, 0]), 2, eps=1e-3)


# ---------------------------------------------------------------- token broadcast


def test_to_token_advantages_zero_on_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    out = to_token_advantages(t([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match=r"mask must be \[batch=3"):
        to_token_advantages(t([1.0, 2.0, 3.0]), mask)


# ---------------------------------------------------------------- GAE / value loss


def test_gae_by_hand_with_padding():
    # row 0: two real tokens, padding carries junk reward 5 and value 9 that must not leak.
    # gamma .9, lam .8:
    #   t=1 (last): delta = 1 - .2 = .8 (no bootstrap past the end) -> A1 = .8
    #   t=0: delta = 0 + .9*.2 - .5 = -.32 -> A0 = -.32 + .9*.8*.8 = .256
    #   returns = A + V = [.756, 1.0]
    # row 1: three tokens, reward 1 at the end, values 0, gamma .5, lam 1 is MC: [.25, .5, 1]
    #   with gamma .9 lam .8 and zero values: A2 = 1, A1 = .72, A0 = .5184
    rewards = t([0.0, 1.0, 5.0], [0.0, 0.0, 1.0])
    values = t([0.5, 0.2, 9.0], [0.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.256, 0.8, 0.0], [0.5184, 0.72, 1.0]])
    close(ret, [[0.756, 1.0, 0.0], [0.5184, 0.72, 1.0]])
    adv_mc, _ = gae(rewards[1:], values[1:], mask[1:], gamma=0.5, lam=1.0)
    close(adv_mc, [[0.25, 0.5, 1.0]])


def test_gae_lambda_zero_is_td_error():
    # lam 0: A_t = r_t + gamma V_{t+1} - V_t = [0 + .5*2 - 1, 3 - 2] = [0, 1]
    adv, _ = gae(t([[0.0, 3.0]]), t([[1.0, 2.0]]), torch.ones(1, 2), gamma=0.5, lam=0.0)
    close(adv, [[0.0, 1.0]])


def test_gae_skips_masked_tokens_inside_a_response():
    # The by-hand row above with a prompt before it and an observation token (junk, NaN) inside:
    # the recursion skips both, so the response tokens get exactly the contiguous row's numbers.
    nan = float("nan")
    rewards = t([nan, 0.0, 7.0, 1.0, 5.0])
    values = t([nan, 0.5, nan, 0.2, 9.0])
    mask = torch.tensor([[0, 1, 0, 1, 0]])
    adv, ret = gae(rewards.view(1, -1), values.view(1, -1), mask, gamma=0.9, lam=0.8)
    close(adv, [[0.0, 0.256, 0.0, 0.8, 0.0]])
    close(ret, [[0.0, 0.756, 0.0, 1.0, 0.0]])


def test_gae_empty_and_zero_length_batches():
    adv, ret = gae(torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 1.0, 0.95)
    assert adv.abs().sum() == 0 and ret.abs().sum() == 0
    adv, ret = gae(torch.ones(2, 0), torch.ones(2, 0), torch.ones(2, 0), 1.0, 0.95)
    assert adv.shape == ret.shape == (2, 0)


def test_gae_rejects_bad_input():
    with pytest.raises(ValueError, match="values shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    for gamma, lam, name in ((1.5, 1.0, "gamma"), (-0.1, 1.0, "gamma"), (1.0, 1.01, "lam"),
                             (True, 1.0, "gamma"), (1.0, "0.9", "lam")):  # fmt: skip
        with pytest.raises(ValueError, match=f"{name} must be a number in"):
            gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma, lam)
    gae(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), 0, 1)  # the bounds are allowed
    values = t([[0.0, float("nan")]])
    with pytest.raises(ValueError, match=r"values must be finite on response tokens; .*\(0, 1\)"):
        gae(torch.zeros(1, 2), values, torch.ones(1, 2), 1.0, 1.0)
    with pytest.raises(ValueError, match="token_rewards must be finite"):
        gae(t([[float("inf"), 0.0]]), torch.zeros(1, 2), torch.ones(1, 2), 1.0, 1.0)


def test_last_token_rewards():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert last_token_rewards(t([1.0, 2.0]), mask).tolist() == [[0, 1, 0], [2, 0, 0]]
    with pytest.raises(ValueError, match=r"no response tokens at batch indices \[1\]"):
        last_token_rewards(t([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))


def test_last_token_rewards_after_a_prompt_and_on_empty_rows():
    # the last unmasked token, not the row's token count - 1: prompts come first, holes inside
    mask = torch.tensor([[0, 0, 1, 0, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    got = last_token_rewards(t([1.0, 2.0, 3.0]), mask, allow_empty=True)
    assert got.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 2], [0] * 6]
    with pytest.raises(ValueError, match=r"batch indices \[2\]"):
        last_token_rewards(t([1.0, 2.0, 3.0]), mask)
    assert last_token_rewards(t([1.0]), torch.ones(1, 0), allow_empty=True).shape == (1, 0)


def test_value_loss_takes_the_larger_error():
    # token 0: v=1, old=.5, R=0: unclipped (1-0)^2 = 1; clipped v=.5+.2=.7 -> .49; max 1 -> .5
    # token 1: v=1, old=.5, R=2: unclipped 1; clipped (.7-2)^2 = 1.69 -> max 1.69 -> .845
    # token 2 is padding (NaN); mean over 2 tokens = (.5 + .845) / 2 = .6725; token 1 is clipped
    values = t([[1.0, 1.0, float("nan")]]).requires_grad_()
    args = (t([[0.5, 0.5, 0.0]]), t([[0.0, 2.0, 0.0]]), torch.tensor([[1, 1, 0]]))
    loss, clip_frac = value_loss(values, *args, clip_range=0.2)
    close(loss, 0.6725)
    close(clip_frac, 0.5)
    assert not clip_frac.requires_grad
    loss.backward()
    # d/dv: token 0 unclipped branch: (v - R)/2 = .5; token 1 clipped branch is flat in v: 0
    close(values.grad, [[0.5, 0.0, 0.0]])
    # a token mean shared with other micro-batches: 0.5 * (1 + 1.69) / 4
    close(value_loss(values, *args, clip_range=0.2, num_tokens=4)[0], 0.33625)


def test_value_loss_rejects_bad_input():
    ones = torch.ones(1, 2)
    for bad in (0, -0.1, float("inf"), True, "0.2"):
        with pytest.raises(ValueError, match="clip_range must be a finite number > 0"):
            value_loss(ones, ones, ones, ones, bad)
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        value_loss(ones, ones, ones, ones, 0.2, num_tokens=0)
    with pytest.raises(ValueError, match="returns shape"):
        value_loss(ones, ones, torch.ones(1, 3), ones, 0.2)


def test_explained_variance():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    returns = t([[1.0, 2.0, float("nan")], [3.0, 0.0, 0.0]])
    close(explained_variance(returns, returns, mask), 1.0)
    # constant values: Var(R - V) = Var(R) = 1 -> 1 - 1 / (1 + 1e-5)
    close(explained_variance(torch.full((2, 3), 5.0), returns, mask), 1 - 1 / (1 + 1e-5), 1e-7)
    # R - V = [1, 2, 3] - [0, 2, 6] = [1, 0, -3]: var 13/3; Var(R) = 1 -> 1 - 13/3
    values = t([[0.0, 2.0, 7.0], [6.0, 0.0, 0.0]])
    close(explained_variance(values, returns, mask), 1 - (13 / 3) / (1 + 1e-5))
    assert math.isnan(explained_variance(values, returns, torch.tensor([[1, 0, 0], [0, 0, 0]])))


def test_ppo_per_sample_advantages_are_zero():
    got = compute_advantages("ppo", t([1.0, 0.0, 3.0]), group_size=1)
    assert got.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="not used by 'ppo'"):
        compute_advantages("ppo", t([1.0, 0.0]), group_size=1, eps=1e-6)
    with pytest.raises(ValueError, match="rewards must be finite"):
        compute_advantages("ppo", t([float("nan"), 0.0]), group_size=1)


def test_whiten():
    # [2,4,6]: mean 4, unbiased var (4+0+4)/2 = 4 -> [-1, 0, 1]; padding stays 0
    mask = torch.tensor([[1, 1, 1, 0]])
    close(whiten(t([[2.0, 4.0, 6.0, 100.0]]), mask), [[-1.0, 0.0, 1.0, 0.0]])
    close(whiten(t([[2.0, 4.0, 6.0, float("nan")]]), mask), [[-1.0, 0.0, 1.0, 0.0]])
    close(whiten(t([[2.0, 4.0, 6.0, 100.0]]), mask, shift_mean=False), [[3.0, 4.0, 5.0, 0.0]])
    with pytest.raises(ValueError, match="at least 2 unmasked"):
        whiten(t([[1.0, 2.0]]), torch.tensor([[1, 0]]))
