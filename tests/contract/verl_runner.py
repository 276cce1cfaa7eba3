"""verl's side of the PPO math contract: `python verl_runner.py IN.pt OUT.pt`, verl on PYTHONPATH.

Runs in its own process (the `.verl-site` target dir on PYTHONPATH, never in the test process).
Reads the cases test_verl_contract.py wrote, already in verl's layout ([B, R] over the response),
and writes what verl's own functions return for them. Imports nothing from lorarl.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import torch
import verl
import verl.utils.torch_functional as verl_F
from verl import DataProto
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.metric_utils import compute_data_metrics


def load_apply_kl_penalty() -> Any:
    """verl's `apply_kl_penalty`, compiled from its own source file.

    It lives in verl/trainer/ppo/ray_trainer.py, whose imports need Ray and torchdata; the
    function itself uses only core_algos, masked_mean and DataProto, so its exact text runs here.
    """
    path = Path(verl.__file__).parent / "trainer" / "ppo" / "ray_trainer.py"
    tree = ast.parse(path.read_text())
    (node,) = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "apply_kl_penalty"
    ]
    module = ast.Module(body=[node], type_ignores=[])
    scope: dict[str, Any] = {
        "core_algos": core_algos,
        "masked_mean": verl_F.masked_mean,
        "DataProto": DataProto,
        "torch": torch,
    }
    exec(compile(module, str(path), "exec"), scope)
    return scope["apply_kl_penalty"]


def run_gae(case: dict[str, Any]) -> dict[str, Any]:
    adv, ret = core_algos.compute_gae_advantage_return(
        case["rewards"], case["values"], case["mask"], gamma=case["gamma"], lam=case["lam"]
    )
    return {"advantages": adv, "returns": ret}


def run_value_loss(case: dict[str, Any]) -> dict[str, Any]:
    loss, frac = core_algos.compute_value_loss(
        vpreds=case["vpreds"],
        returns=case["returns"],
        values=case["values"],
        response_mask=case["mask"],
        cliprange_value=case["clip"],
        loss_agg_mode="token-mean",
    )
    return {"loss": loss, "clipfrac": frac}


def run_explained_var(case: dict[str, Any]) -> dict[str, Any]:
    mask = case["mask"]
    b, r = mask.shape
    zeros = torch.zeros(b, r)
    batch = DataProto.from_dict(
        tensors={
            "token_level_scores": zeros,
            "token_level_rewards": zeros,
            "advantages": zeros,
            "returns": case["returns"],
            "values": case["values"],
            "prompts": torch.zeros(b, 2, dtype=torch.long),
            "responses": torch.zeros(b, r, dtype=torch.long),
            "response_mask": mask,
            "attention_mask": torch.cat([torch.ones(b, 2), mask.float()], dim=1),
        }
    )
    metrics = compute_data_metrics(batch, use_critic=True)
    return {"vf_explained_var": metrics["critic/vf_explained_var"]}


def run_kl(case: dict[str, Any], apply_kl_penalty: Any) -> dict[str, Any]:
    if case["controller"] == "adaptive":
        ctrl = core_algos.AdaptiveKLController(case["coef"], case["target_kl"], case["horizon"])
    else:
        ctrl = core_algos.FixedKLController(case["coef"])
    data = DataProto.from_dict(
        tensors={
            "response_mask": case["mask"],
            "token_level_scores": case["scores"],
            "old_log_probs": case["logprobs"],
            "ref_log_prob": case["ref_logprobs"],
        }
    )
    data, metrics = apply_kl_penalty(data, ctrl, kl_penalty=case["estimator"])
    adv, ret = core_algos.compute_gae_advantage_return(
        data.batch["token_level_rewards"], case["values"], case["mask"], gamma=1.0, lam=0.95
    )
    return {
        "advantages": adv,
        "returns": ret,
        "token_level_rewards": data.batch["token_level_rewards"],
        "current_kl": metrics["actor/reward_kl_penalty"],
        "beta": metrics["actor/reward_kl_penalty_coeff"],
        "value_after": float(ctrl.value),
    }


def run_controller(case: dict[str, Any]) -> dict[str, Any]:
    ctrl = core_algos.get_kl_controller(_Cfg(case))
    values = []
    for kl, n in zip(case["kls"], case["n_steps"], strict=True):
        ctrl.update(current_kl=kl, n_steps=n)
        values.append(float(ctrl.value))
    return {"values": values}


class _Cfg:
    """verl's kl_ctrl config object (type, kl_coef, target_kl, horizon)."""

    def __init__(self, case: dict[str, Any]) -> None:
        self.type = case["controller"]
        self.kl_coef = case["coef"]
        self.target_kl = case["target_kl"]
        self.horizon = case["horizon"]


def main() -> None:
    cases = torch.load(sys.argv[1], weights_only=False)
    apply_kl_penalty = load_apply_kl_penalty()
    out = {
        "verl_version": verl.__version__,
        "gae": [run_gae(c) for c in cases["gae"]],
        "value_loss": [run_value_loss(c) for c in cases["value_loss"]],
        "explained_var": [run_explained_var(c) for c in cases["explained_var"]],
        "kl": [run_kl(c, apply_kl_penalty) for c in cases["kl"]],
        "controller": [run_controller(c) for c in cases["controller"]],
    }
    torch.save(out, sys.argv[2])


if __name__ == "__main__":
    main()
