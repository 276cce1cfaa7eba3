"""verl's side of the REINFORCE++ contract: `python verl_reinforce_runner.py IN.pt OUT.pt`.

Runs in its own process with the `.verl-site` target dir on PYTHONPATH (never in the test
process); reads the cases test_verl_reinforce_pp.py wrote in verl's layout ([B, R] over the
response, the outcome reward on each row's last response token) and writes what verl's own
estimators return for them. Imports nothing from lorarl.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    rewards, mask = case["token_level_rewards"], case["mask"]
    plain, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=SimpleNamespace(gamma=1.0)
    )
    baseline, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        rewards, mask, np.array(case["index"], dtype=object)
    )
    return {"reinforce_plus_plus": plain, "reinforce_plus_plus_baseline": baseline}


def main() -> None:
    cases = torch.load(sys.argv[1], weights_only=False)
    out = {"verl_version": verl.__version__, "cases": [run_case(c) for c in cases]}
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
