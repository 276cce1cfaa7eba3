"""PPO's math against verl's own code on the same tensors: GAE + whitening, the clipped value loss,
explained variance, the KL penalty in the reward and the KL controllers.

verl 0.9.1 lives in `.verl-site` (`make verl-site`, a `pip --target` dir) and runs in one
subprocess (verl_runner.py) for every comparison, so it never enters this process. Our tensors
are [B, T] over prompt + completion, the response mask 0 on the prompt, on padding and on holes
inside a response (multi-turn observation tokens); verl's are [B, R] over the response only. Each
case is built in our layout, with junk (NaN on the prompt) wherever the mask is 0, and verl gets
each row's response slice. Without the site every test here skips, saying how to build it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lorarl.trainer.rl.advantages import (
    explained_variance,
    gae,
    last_token_rewards,
    value_loss,
    whiten,
)
from lorarl.trainer.rl.kl_reward import KLController, current_kl, kl_in_reward

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "verl_runner.py"
VERL_VERSION = "0.9.1"
SEEDS = (0, 1, 2, 3)
TOL = {"atol": 1e-5, "rtol": 1e-5}
# one ~15 s subprocess (importing torch, verl and transformers) for the whole module
pytestmark = pytest.mark.slow


def verl_site() -> Path:
    """The verl target dir; LORARL_VERL_SITE overrides `.verl-site`."""
    return Path(os.environ.get("LORARL_VERL_SITE", ROOT / ".verl-site"))


@dataclass
class Layout:
    """One batch in both layouts: ``ours`` [B, T] and the response columns ``cols`` [B, R]."""

    mask: torch.Tensor  # ours, [B, T]
    cols: torch.Tensor  # [B, R]: row i's response position j is our column cols[i, j]

    def to_verl(self, x: torch.Tensor) -> torch.Tensor:
        return x.gather(1, self.cols)

    def ours(self, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
        """Random values where the mask is 1; junk elsewhere, NaN on the prompt."""
        x = torch.randn(self.mask.shape, generator=gen) * scale
        prompt = torch.arange(x.shape[1]) < self.cols[:, :1]
        junk = torch.randn(x.shape, generator=gen) * 100
        x = torch.where(self.mask.bool(), x, junk)
        return torch.where(prompt, torch.full_like(x, float("nan")), x)


def layout(seed: int, *, batch: int = 6, max_prompt: int = 7, max_resp: int = 12) -> Layout:
    """Right-padded responses after prompts of different lengths: row 0 has one token, row 1 is
    a full-length response, odd seeds add holes inside responses and an empty last row."""
    gen = torch.Generator().manual_seed(seed)
    n_tokens = max_prompt + max_resp
    mask = torch.zeros(batch, n_tokens, dtype=torch.long)
    cols = torch.zeros(batch, max_resp, dtype=torch.long)
    for i in range(batch):
        p = int(torch.randint(1, max_prompt + 1, (1,), generator=gen))
        r = int(torch.randint(1, max_resp + 1, (1,), generator=gen))
        r = 1 if i == 0 else max_resp if i == 1 else r
        if seed % 2 and i == batch - 1:
            r = 0  # a filler row with no response tokens
        resp = torch.ones(r, dtype=torch.long)
        if seed % 2 and r > 2:
            resp[torch.rand(r, generator=gen) < 0.3] = 0  # observation tokens inside the response
        mask[i, p : p + r] = resp
        cols[i] = p + torch.arange(max_resp)
    return Layout(mask=mask, cols=cols)


def build_cases() -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[Any]]]:
    """(verl's inputs, our outputs) for every comparison."""
    verl_in: dict[str, list[dict[str, Any]]] = {
        "gae": [], "value_loss": [], "explained_var": [], "kl": [], "controller": []
    }  # fmt: skip
    ours: dict[str, list[Any]] = {k: [] for k in verl_in}
    for seed in SEEDS:
        gen = torch.Generator().manual_seed(100 + seed)
        lay = layout(seed)
        v_mask = lay.to_verl(lay.mask)
        for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 1.0), (0.9, 0.0)):
            rewards, values = lay.ours(gen), lay.ours(gen)
            adv, ret = gae(rewards, values, lay.mask, gamma=gamma, lam=lam)
            ours["gae"].append((lay, whiten(adv, lay.mask), ret, adv))
            verl_in["gae"].append(
                {"rewards": lay.to_verl(rewards), "values": lay.to_verl(values), "mask": v_mask,
                 "gamma": gamma, "lam": lam}
            )  # fmt: skip
        for clip in (0.2, 0.5):
            vpreds, old, returns = lay.ours(gen), lay.ours(gen), lay.ours(gen, 2.0)
            ours["value_loss"].append(value_loss(vpreds, old, returns, lay.mask, clip))
            verl_in["value_loss"].append(
                {"vpreds": lay.to_verl(vpreds), "values": lay.to_verl(old),
                 "returns": lay.to_verl(returns), "mask": v_mask, "clip": clip}
            )  # fmt: skip
        returns = lay.ours(gen)
        values = torch.where(lay.mask.bool(), returns + 0.3 * lay.ours(gen), returns)
        ours["explained_var"].append(explained_variance(values, returns, lay.mask))
        verl_in["explained_var"].append(
            {"values": lay.to_verl(values), "returns": lay.to_verl(returns), "mask": v_mask}
        )
        for estimator in ("kl", "k1", "mse", "k2", "low_var_kl", "k3"):
            # a spread of 8 nats hits low_var_kl's clamps (kl at 20, its estimate at 10)
            ref = lay.ours(gen)
            logp = ref + torch.randn(ref.shape, generator=gen) * (8.0 if seed == 0 else 0.5)
            outcomes = torch.randn(lay.mask.shape[0], generator=gen)
            scores = last_token_rewards(outcomes, lay.mask, allow_empty=True)
            controller = "adaptive" if estimator in ("mse", "low_var_kl") else "fixed"
            ctrl = KLController(0.05, controller, target_kl=0.1, horizon=50)
            est = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(estimator, estimator)
            penalized, kl = kl_in_reward(scores, logp, ref, lay.mask, ctrl.value, est)
            kl_now = current_kl(kl, lay.mask)
            ctrl.update(kl_now, n_steps=lay.mask.shape[0])
            # the whole reward path: outcome, KL penalty, GAE over values, whitening
            values = lay.ours(gen)
            adv, ret = gae(penalized, values, lay.mask, gamma=1.0, lam=0.95)
            chain = (whiten(adv, lay.mask), ret)
            ours["kl"].append((lay, penalized, kl_now, ctrl.value, chain))
            verl_in["kl"].append(
                {"scores": lay.to_verl(scores), "logprobs": lay.to_verl(logp),
                 "ref_logprobs": lay.to_verl(ref), "mask": v_mask, "estimator": estimator,
                 "values": lay.to_verl(values),
                 "coef": 0.05, "controller": controller, "target_kl": 0.1, "horizon": 50}
            )  # fmt: skip
    for seed, controller in ((0, "adaptive"), (1, "adaptive"), (2, "fixed")):
        gen = torch.Generator().manual_seed(200 + seed)
        kls = (torch.rand(20, generator=gen) * 0.4).tolist()  # target 0.1: both clip edges hit
        n_steps = torch.randint(1, 300, (20,), generator=gen).tolist()
        ctrl = KLController(0.2, controller, target_kl=0.1, horizon=1000)
        ours["controller"].append([ctrl.update(k, n) for k, n in zip(kls, n_steps, strict=True)])
        verl_in["controller"].append(
            {"controller": controller, "coef": 0.2, "target_kl": 0.1, "horizon": 1000,
             "kls": kls, "n_steps": n_steps}
        )  # fmt: skip
    return verl_in, ours


@pytest.fixture(scope="module")
def verl_vs_ours(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    site = verl_site()
    if not (site / "verl").is_dir():
        pytest.skip(
            f"verl contract site not found at {site}: build it with `make verl-site` "
            "or set LORARL_VERL_SITE"
        )
    work = tmp_path_factory.mktemp("verl-contract")
    verl_in, ours = build_cases()
    torch.save(verl_in, work / "in.pt")
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(RUNNER), str(work / "in.pt"), str(work / "out.pt")],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"verl runner exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return torch.load(work / "out.pt", weights_only=False), ours


def test_runs_the_pinned_verl(verl_vs_ours):
    assert verl_vs_ours[0]["verl_version"] == VERL_VERSION


def test_gae_whitened_advantages_and_returns_match_verl(verl_vs_ours):
    verl, ours = verl_vs_ours
    assert len(verl["gae"]) == len(ours["gae"]) == 16
    for got, (lay, adv_w, ret, adv_raw) in zip(verl["gae"], ours["gae"], strict=True):
        m = lay.to_verl(lay.mask).bool()
        # verl leaves values on masked positions; ours are 0 there
        torch.testing.assert_close(lay.to_verl(adv_w)[m], got["advantages"][m], **TOL)
        torch.testing.assert_close(lay.to_verl(ret)[m], got["returns"][m], **TOL)
        assert not adv_raw[~lay.mask.bool()].any() and not ret[~lay.mask.bool()].any()


def test_value_loss_and_clip_fraction_match_verl(verl_vs_ours):
    verl, ours = verl_vs_ours
    fracs = []
    for got, (loss, frac) in zip(verl["value_loss"], ours["value_loss"], strict=True):
        torch.testing.assert_close(loss, got["loss"], **TOL)
        torch.testing.assert_close(frac, got["clipfrac"], **TOL)
        fracs.append(float(frac))
    assert min(fracs) > 0 and max(fracs) < 1  # both branches exercised


def test_explained_variance_matches_verl(verl_vs_ours):
    verl, ours = verl_vs_ours
    for got, mine in zip(verl["explained_var"], ours["explained_var"], strict=True):
        assert float(mine) == pytest.approx(got["vf_explained_var"], rel=1e-5, abs=1e-6)


def test_kl_in_reward_current_kl_and_controller_step_match_verl(verl_vs_ours):
    verl, ours = verl_vs_ours
    assert len(verl["kl"]) == 24
    for got, (lay, penalized, kl_now, value_after, chain) in zip(
        verl["kl"], ours["kl"], strict=True
    ):
        m = lay.to_verl(lay.mask).bool()
        assert got["beta"] == 0.05
        torch.testing.assert_close(lay.to_verl(penalized)[m], got["token_level_rewards"][m], **TOL)
        # no response tokens: verl counts an empty row as KL 0, ours leaves it out
        n_rows, n_full = m.shape[0], int(m.any(dim=1).sum())
        assert kl_now * n_full / n_rows == pytest.approx(got["current_kl"], rel=1e-5, abs=1e-7)
        if n_full == n_rows:
            assert value_after == pytest.approx(got["value_after"], rel=1e-6)
        torch.testing.assert_close(lay.to_verl(chain[0])[m], got["advantages"][m], **TOL)
        torch.testing.assert_close(lay.to_verl(chain[1])[m], got["returns"][m], **TOL)


def test_kl_controller_trajectory_matches_verl_over_20_updates(verl_vs_ours):
    verl, ours = verl_vs_ours
    for got, mine in zip(verl["controller"], ours["controller"], strict=True):
        assert mine == pytest.approx(got["values"], rel=1e-12)
    adaptive, fixed = ours["controller"][0], ours["controller"][2]
    assert len(set(adaptive)) == 20 and set(fixed) == {0.2}
