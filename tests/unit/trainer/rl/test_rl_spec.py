"""The RL half of the spec (issue 13): what each algorithm name means, what the trainer and the
engines are told, and what is refused."""

from __future__ import annotations

import copy

import pytest

from lorarl.api import LoRARLJob
from lorarl.api.validation import check_manifest
from lorarl.plan import plan

BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


def doc(**spec) -> dict:
    d = copy.deepcopy(BASE)
    d["spec"].update(spec)
    return d


def make(**spec) -> LoRARLJob:
    return LoRARLJob.model_validate(doc(**spec))


def problems(**spec) -> list[str]:
    return [str(p) for p in check_manifest(doc(**spec), cluster=False)]


def test_temperature_zero_is_refused_for_training_naming_the_field():
    found = problems(rollout={"sampling": {"temperature": 0}})
    assert any(p.startswith("spec.rollout.sampling.temperature: must be > 0") for p in found), found
    assert problems(rollout={"sampling": {"temperature": 0.7}}) == []


def _engine(job: LoRARLJob):
    return plan(job).role("rollout").replicas[0].containers[0]


def test_both_engines_are_told_to_report_post_temperature_logprobs():
    vllm = _engine(make(rollout={"engine": "vllm", "gpusPerReplica": 0}))
    flag = vllm.command.index("--logprobs-mode")
    assert vllm.command[flag + 1] == "processed_logprobs"
    sglang = _engine(make(rollout={"engine": "sglang"}))
    assert sglang.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "false"


def test_rollout_correction_and_dual_clip_are_on_by_default_and_can_be_turned_off():
    from lorarl.trainer.rl.config import loss_config

    cfg = loss_config(make())
    assert (cfg.correction, cfg.correction_threshold, cfg.dual_clip) == ("tis", 2.0, 3.0)
    off = loss_config(make(algorithm={"dualClip": None, "rolloutCorrection": {"mode": "off"}}))
    assert (off.correction, off.dual_clip) == ("off", None)
    masked = loss_config(make(algorithm={"rolloutCorrection": {"mode": "mask-token",
                                                               "threshold": 3}}))  # fmt: skip
    assert (masked.correction, masked.correction_threshold) == ("mask-token", 3.0)
    assert any("rolloutCorrection.threshold" in p
               for p in problems(algorithm={"rolloutCorrection": {"threshold": 1}}))  # fmt: skip


def test_dapo_is_the_dapo_recipe_and_each_part_can_be_overridden():
    """Issue 13 #7: `dapo` used to be GRPO advantages and nothing else."""
    from lorarl.trainer.rl.config import algorithm_choices, loss_config

    dapo = algorithm_choices(make(algorithm={"name": "dapo"}))
    assert (dapo.clip_high, dapo.dynamic_sampling, dapo.agg) == (0.28, True, "token-mean")
    assert (dapo.soft_punishment, dapo.buffer_tokens, dapo.overlong_mask) == (True, 256 // 5, False)
    assert loss_config(make(algorithm={"name": "dapo"})).clip_high == 0.28
    custom = algorithm_choices(make(algorithm={
        "name": "dapo", "clipRatioHigh": 0.25, "dynamicSampling": {"enabled": False},
        "lossAggregation": "seq-mean-token-mean",
        "overlong": {"softPunishment": False, "mask": True},
    }))  # fmt: skip
    assert (custom.clip_high, custom.dynamic_sampling, custom.agg) == (
        0.25, False, "seq-mean-token-mean",
    )  # fmt: skip
    assert (custom.soft_punishment, custom.overlong_mask) == (False, True)
    grpo = algorithm_choices(make())
    assert (grpo.clip_high, grpo.dynamic_sampling, grpo.agg, grpo.soft_punishment) == (
        0.2, False, "token-mean", False,
    )  # fmt: skip
    on = algorithm_choices(make(algorithm={"dynamicSampling": {"enabled": True},
                                           "overlong": {"softPunishment": True,
                                                        "bufferTokens": 32}}))  # fmt: skip
    assert (on.dynamic_sampling, on.soft_punishment, on.buffer_tokens) == (True, True, 32)


def test_dr_grpo_divides_by_a_constant_length():
    """Issue 13 #10: seq-mean-token-sum had no constant, so the loss grew with length."""
    from lorarl.trainer.rl.config import loss_config

    cfg = loss_config(
        make(
            algorithm={"name": "dr_grpo"},
            data={"trainFiles": ["t.jsonl"], "maxResponseTokens": 300},
        )
    )
    assert (cfg.agg, cfg.norm_len) == ("seq-mean-token-sum-norm", 300)
    cfg = loss_config(make(algorithm={"name": "dr_grpo", "lossNormLength": 128}))
    assert cfg.norm_len == 128
    assert loss_config(make()).norm_len is None


def test_name_dependent_defaults_are_left_unset_in_the_crd():
    """The API server must not fill in a default the algorithm name would change."""
    from lorarl.api.crd import crd

    algo = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]["algorithm"]["properties"]  # fmt: skip
    for field in ("clipRatioHigh", "lossAggregation", "lossNormLength"):
        assert "default" not in algo[field], field
        assert "Default" in algo[field]["description"], field
    assert "default" not in algo["dynamicSampling"]["properties"]["enabled"]
    assert "default" not in algo["overlong"]["properties"]["softPunishment"]


@pytest.mark.parametrize(("alias", "same"), [("mse", "k2"), ("low_var_kl", "k3")])
def test_verl_kl_names_are_accepted(alias, same):
    from lorarl.trainer.rl.config import loss_config

    cfg = loss_config(make(algorithm={"kl": {"coef": 0.1, "estimator": alias}}))
    assert cfg.kl_estimator == alias
    assert problems(algorithm={"kl": {"coef": 0.1, "estimator": alias}}) == []


def test_k1_as_a_loss_is_warned_about(caplog):
    from lorarl.trainer.rl.config import loss_config

    with caplog.at_level("WARNING"):
        loss_config(make(algorithm={"kl": {"coef": 0.1, "estimator": "k1"}}))
    assert "zero gradient in expectation" in caplog.text


def test_kl_reference_initial_adapter_needs_an_adapter():
    found = problems(algorithm={"kl": {"coef": 0.1, "reference": "initialAdapter"}})
    assert any(p.startswith("spec.algorithm.kl.reference: initialAdapter needs") for p in found)
    ok = problems(algorithm={"kl": {"coef": 0.1, "reference": "initialAdapter"}},
                  lora={"adapterPath": "/adapters/sft"})  # fmt: skip
    assert ok == []


def test_ppo_maps_to_its_estimator_and_the_critic_defaults_follow_the_actor():
    from lorarl.trainer.model.loading import LoraSettings
    from lorarl.trainer.rl.config import advantage_estimator
    from lorarl.trainer.update.ppo import critic_settings

    lora = {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"],
            "excludeModules": ["v_proj"], "useRslora": True, "dropout": 0.1}  # fmt: skip
    job = make(algorithm={"name": "ppo"}, lora=lora)
    assert advantage_estimator(job) == "ppo"
    c = critic_settings(job)
    assert c.lora == LoraSettings(
        rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "v_proj"],
        exclude_modules=["v_proj"], use_rslora=True, adapter_path=None,
    )  # fmt: skip
    assert (c.lr, c.betas, c.weight_decay, c.warmup_steps_lr, c.scheduler, c.grad_clip) == (
        1e-4, (0.9, 0.999), 0.0, 0, "constant", 1.0,
    )  # fmt: skip
    assert (c.value_clip, c.warmup_steps, c.vf_coef) == (0.5, 0, 1.0)
    assert critic_settings(make(algorithm={"name": "ppo"}, critic={})) == critic_settings(
        make(algorithm={"name": "ppo"})
    )
    default = critic_settings(make(algorithm={"name": "ppo"})).lora
    assert (default.rank, default.target_modules) == (32, "all-linear")


def test_the_critics_own_settings_override_the_actors():
    from lorarl.trainer.update.ppo import critic_settings

    critic = {
        "lora": {"rank": 4, "alpha": 8, "targetModules": ["all-linear"], "excludeModules": [],
                 "useRslora": False},
        "optim": {"lr": 3e-4, "betas": [0.8, 0.9], "weightDecay": 0.1, "warmupSteps": 7,
                  "scheduler": "cosine", "gradClip": 0.3},
        "valueClip": 0.2, "warmupSteps": 3, "vfCoef": 0.5,
    }  # fmt: skip
    lora = {"rank": 16, "targetModules": ["q_proj"], "excludeModules": ["k"], "useRslora": True}
    c = critic_settings(make(algorithm={"name": "ppo"}, lora=lora, critic=critic))
    assert (c.lora.rank, c.lora.alpha, c.lora.target_modules) == (4, 8.0, "all-linear")
    assert (c.lora.exclude_modules, c.lora.use_rslora) == ([], False)
    assert (c.lr, c.betas, c.weight_decay, c.warmup_steps_lr, c.scheduler, c.grad_clip) == (
        3e-4, (0.8, 0.9), 0.1, 7, "cosine", 0.3,
    )  # fmt: skip
    assert (c.value_clip, c.warmup_steps, c.vf_coef) == (0.2, 3, 0.5)


def test_kl_in_reward_moves_the_kl_from_the_loss_to_the_rewards(caplog):
    from lorarl.trainer.rl.config import kl_reward_settings, loss_config

    loss_kl = make(algorithm={"name": "ppo", "kl": {"coef": 0.05, "estimator": "k2"}})
    assert kl_reward_settings(loss_kl) is None
    assert loss_config(loss_kl).kl_coef == 0.05
    kl = {"coef": 0.05, "estimator": "k1", "inReward": True, "controller": "adaptive",
          "targetKl": 0.2, "horizon": 500}  # fmt: skip
    job = make(algorithm={"name": "ppo", "kl": kl})
    with caplog.at_level("WARNING"):
        cfg = loss_config(job)
    assert cfg.kl_coef == 0.0
    assert "zero gradient" not in caplog.text  # k1 is a fine reward penalty (verl's "kl")
    r = kl_reward_settings(job)
    assert (r.coef, r.estimator, r.controller, r.target_kl, r.horizon) == (
        0.05, "k1", "adaptive", 0.2, 500,
    )  # fmt: skip
    fixed = kl_reward_settings(
        make(algorithm={"name": "ppo", "kl": {"coef": 0.01, "inReward": True}})
    )
    assert (fixed.coef, fixed.controller, fixed.estimator) == (0.01, "fixed", "k3")


def test_the_critic_lora_leaves_its_defaults_to_the_actor_in_the_crd():
    """The API server must not fill in a rank the actor's spec.lora would decide."""
    from lorarl.api.crd import crd

    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    critic = spec["properties"]["critic"]
    assert "default" not in critic  # unset is "ppo with every default", not "no critic"
    for field, node in critic["properties"]["lora"]["properties"].items():
        assert "default" not in node and "Default: lora." in node["description"], field
    assert critic["properties"]["optim"]["properties"]["lr"]["default"] == 1e-4
