"""KL in the reward and the KL controllers against values worked out by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lorarl.trainer.rl.kl_reward import KLController, current_kl, kl_in_reward, per_sequence_kl

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(actual, t(expected), atol=tol, rtol=0)


# row 0: a prompt token (NaN logprobs), two response tokens, padding; row 1: one token
LOGP = t([[NAN, -1.0, -2.0, 0.0], [NAN, -0.5, NAN, NAN]])
REF = t([[NAN, -1.5, -1.0, 9.0], [NAN, -0.5, NAN, NAN]])
MASK = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]])
SCORES = t([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])


def test_k1_penalty_on_response_tokens_only():
    # k1 = logp - ref: [.5, -1] on row 0, 0 on row 1; prompt and padding get no penalty
    rewards, kl = kl_in_reward(SCORES, LOGP, REF, MASK, coef=0.1, estimator="k1")
    close(kl, [[0.0, 0.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    close(rewards, [[0.0, -0.05, 1.1, 0.0], [0.0, 2.0, 0.0, 0.0]])


def test_k3_and_k2_estimators():
    # k3: d = ref - logp; exp(d) - d - 1: d=-.5 -> .1065307, d=1 -> e - 2 = .7182818
    _, kl = kl_in_reward(SCORES, LOGP, REF, MASK, coef=0.1, estimator="low_var_kl")
    close(kl[0], [0.0, math.exp(-0.5) - 0.5, math.e - 2, 0.0])
    # k2: 0.5 * d^2 = [.125, .5]
    _, kl = kl_in_reward(SCORES, LOGP, REF, MASK, coef=0.1, estimator="k2")
    close(kl[0], [0.0, 0.125, 0.5, 0.0])


def test_penalty_carries_no_gradient():
    logp = LOGP.clone().requires_grad_()
    rewards, kl = kl_in_reward(SCORES, logp, REF, MASK, coef=0.1, estimator="k3")
    assert not rewards.requires_grad and not kl.requires_grad


def test_kl_in_reward_rejects_bad_input():
    with pytest.raises(ValueError, match=r"non-finite KL .* at \[\(0, 1\), \(1, 1\)\]"):
        kl_in_reward(SCORES, t([[0.0, NAN, 0.0, 0.0]] * 2), REF, MASK, 0.1, "k1")
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        kl_in_reward(SCORES, LOGP, REF, MASK, -0.1, "k1")
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        kl_in_reward(SCORES, LOGP, REF[:, :3], MASK, 0.1, "k1")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_in_reward(SCORES, LOGP, REF, MASK, 0.1, "k4")


def test_current_kl_is_a_mean_over_sequences_skipping_empty_rows():
    # row 0 token-mean (1+1+1+1)/4 = 1, row 1 = 3, row 2 empty: (1 + 3) / 2 = 2;
    # a token mean over all 5 tokens would be 7/5
    kl = t([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert current_kl(kl, mask) == pytest.approx(2.0)
    means, has = per_sequence_kl(kl, mask)
    assert means.tolist() == [1.0, 3.0, 0.0] and has.tolist() == [True, True, False]
    assert current_kl(kl, torch.zeros_like(mask)) == 0.0


def test_fixed_controller_never_moves():
    ctrl = KLController(0.05)
    assert [ctrl.update(kl, 64) for kl in (0.0, 1.0, 100.0)] == [0.05] * 3


def test_adaptive_controller_by_hand():
    # target .1, horizon 100, 10 sequences a step:
    # kl .15: error .5 clipped to .2 -> x(1 + .2 * 10/100) = x1.02
    # kl .05: error -.5 clipped to -.2 -> x.98; kl .11: error .1 -> x1.01
    ctrl = KLController(0.1, "adaptive", target_kl=0.1, horizon=100)
    assert ctrl.update(0.15, 10) == pytest.approx(0.102)
    assert ctrl.update(0.05, 10) == pytest.approx(0.102 * 0.98)
    assert ctrl.update(0.11, 10) == pytest.approx(0.102 * 0.98 * 1.01)
    assert ctrl.update(0.5, 0) == pytest.approx(0.102 * 0.98 * 1.01)


def test_state_dict_resumes_the_adaptive_beta_exactly():
    ctrl = KLController(0.2, "adaptive", target_kl=0.05, horizon=500)
    for kl in (0.3, 0.01, 0.07):
        ctrl.update(kl, 128)
    state = json.loads(json.dumps(ctrl.state_dict()))  # a plain, JSON-able dict
    resumed = KLController(0.2, "adaptive", target_kl=0.05, horizon=500)
    resumed.load_state_dict(state)
    assert resumed.value == ctrl.value != 0.2
    assert resumed.update(0.2, 64) == ctrl.update(0.2, 64)


def test_controller_rejects_bad_input():
    with pytest.raises(ValueError, match="kl controller must be one of fixed, adaptive; got 'pid'"):
        KLController(0.1, "pid")
    with pytest.raises(ValueError, match="target_kl must be a finite number > 0"):
        KLController(0.1, "adaptive", target_kl=0.0)
    with pytest.raises(ValueError, match="horizon must be an integer > 0"):
        KLController(0.1, "adaptive", horizon=0)
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        KLController(NAN)
    ctrl = KLController(0.1, "adaptive")
    with pytest.raises(ValueError, match="current_kl must be a finite number"):
        ctrl.update(NAN, 8)
    with pytest.raises(ValueError, match="n_steps must be an integer >= 0"):
        ctrl.update(0.1, -1)
    with pytest.raises(ValueError, match="state is for 'fixed', this run uses 'adaptive'"):
        ctrl.load_state_dict(KLController(0.1).state_dict())
    with pytest.raises(ValueError, match="state value must be a finite number >= 0"):
        ctrl.load_state_dict({"controller": "adaptive", "value": -1.0})
    with pytest.raises(ValueError, match="must be a dict with a 'value'"):
        ctrl.load_state_dict({"controller": "adaptive"})
    assert ctrl.value == 0.1  # nothing above changed it
