"""REINFORCE++ and REINFORCE++-baseline advantages against verl's own estimators on the same
rewards and response masks (per-token whitening over every response token of the batch).

verl lives in `.verl-site` (`make verl-site`) and runs in one subprocess
(verl_reinforce_runner.py). Each case has rows of very different lengths (1 token to the full
width), holes inside responses (multi-turn observation tokens, mask 0, which neither side
counts) and groups whose rewards are all equal. Without the site every test here skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lorarl.trainer.generation.rollouts import _token_counts
from lorarl.trainer.generation.types import Sample
from lorarl.trainer.rl.advantages import compute_advantages

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "verl_reinforce_runner.py"
VERL_VERSION = "0.9.1"
GROUP = 4
TOL = {"atol": 1e-5, "rtol": 1e-5}
pytestmark = pytest.mark.slow  # one subprocess importing torch and verl


def verl_site() -> Path:
    return Path(os.environ.get("LORARL_VERL_SITE", ROOT / ".verl-site"))


def make_case(seed: int, groups: int = 4, width: int = 48) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    b = groups * GROUP
    mask = torch.zeros(b, width, dtype=torch.long)
    for i in range(b):
        n = int(torch.randint(1, width + 1, (1,), generator=gen))
        n = 1 if i == 0 else width if i == 1 else n
        row = torch.ones(n, dtype=torch.long)
        if seed % 2 and n > 3:  # observation tokens inside the response, never the last one
            row[:-1][torch.rand(n - 1, generator=gen) < 0.3] = 0
        mask[i, :n] = row
    if seed < 2:  # binary accuracy: short right answers, long wrong ones, one all-right group
        lengths = mask.sum(1)
        scores = (lengths < lengths.median()).float()
        scores[-GROUP:] = 1.0
    else:
        scores = torch.randn(b, generator=gen).round(decimals=1)
        scores[:GROUP] = 0.3  # a constant group
    last = mask.shape[1] - 1 - mask.flip(1).argmax(dim=1)
    token_rewards = torch.zeros(b, width)
    token_rewards[torch.arange(b), last] = scores
    return {
        "token_level_rewards": token_rewards,
        "mask": mask,
        "index": [f"prompt-{i // GROUP}" for i in range(b)],
        "scores": scores,
    }


@pytest.fixture(scope="module")
def cases_and_verl(tmp_path_factory: pytest.TempPathFactory):
    site = verl_site()
    if not (site / "verl").is_dir():
        pytest.skip(
            f"verl contract site not found at {site}: build it with `make verl-site` "
            "or set LORARL_VERL_SITE"
        )
    work = tmp_path_factory.mktemp("verl-reinforce")
    cases = [make_case(seed) for seed in range(6)]
    torch.save(cases, work / "in.pt")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(RUNNER), str(work / "in.pt"), str(work / "out.pt")],
        cwd=work, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"verl runner exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return cases, torch.load(work / "out.pt", weights_only=False)


def _counts(case: dict[str, Any]) -> list[int]:
    """What the trainer passes: each sample's loss-mask tokens (rollouts._token_counts)."""
    samples = []
    for row in case["mask"]:
        n = int(row.nonzero().max()) + 1
        samples.append(
            Sample(prompt_ids=[1], completion_ids=[5] * n, logprobs=[0.0] * n,
                   finish_reason="stop", weight_version=0, endpoint="e",
                   loss_mask=tuple(int(v) for v in row[:n]))
        )  # fmt: skip
    return _token_counts(samples)


def test_runs_the_pinned_verl(cases_and_verl):
    assert cases_and_verl[1]["verl_version"] == VERL_VERSION


@pytest.mark.parametrize(
    ("ours", "theirs", "group"),
    [
        ("reinforce_pp", "reinforce_plus_plus", 1),
        ("reinforce_pp_baseline", "reinforce_plus_plus_baseline", GROUP),
    ],
)
def test_advantages_match_verl_on_every_response_token(cases_and_verl, ours, theirs, group):
    cases, verl = cases_and_verl
    for case, got in zip(cases, verl["cases"], strict=True):
        counts = _counts(case)
        assert counts == case["mask"].sum(1).tolist()
        adv = compute_advantages(ours, case["scores"], group, token_counts=counts)
        mine = adv.unsqueeze(1) * case["mask"]  # one value per sample, on its response tokens
        m = case["mask"].bool()
        torch.testing.assert_close(mine[m], got[theirs][m], **TOL)


def test_the_cases_tell_per_token_from_per_sequence(cases_and_verl):
    """The comparison above would catch per-sequence normalization: on these rewards it differs
    from verl's by far more than the tolerance."""
    cases, verl = cases_and_verl
    case, got = cases[0], verl["cases"][0]["reinforce_plus_plus"]
    per_seq = compute_advantages("reinforce_pp", case["scores"], 1, token_counts=[1] * 16)
    m = case["mask"].bool()
    assert (per_seq.unsqueeze(1).expand_as(got)[m] - got[m]).abs().max() > 0.3
