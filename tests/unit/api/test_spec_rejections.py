"""Fields that would be accepted and ignored are refused instead (issue 14), by the models and by
the CRD's CEL alike; what is supported is still accepted. The refusals' messages are pinned by
examples/bad (test_api, test_crd); this checks the boundaries on both sides."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from harness.cluster.crd_server import CrdServer
from lorarl.api.crd import crd
from lorarl.api.resource import LoRARLJob
from lorarl.api.validation import check_manifest

MINIMAL = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "j"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"trainFiles": ["t.jsonl"]},
        "training": {"outputDir": "/out", "volume": {"claimName": "out", "mountPath": "/out"}},
    },
}


@pytest.fixture(scope="module")
def cel(crd_server: CrdServer) -> CrdServer:
    """The CRD's side: the real API server's verdict."""
    return crd_server


def with_spec(section: str, value: dict) -> dict:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"].setdefault(section, {}).update(value)
    return doc


def verdicts(doc: dict, cel: CrdServer) -> tuple[bool, bool]:
    """(pydantic accepts, the CRD accepts)."""
    try:
        LoRARLJob.model_validate(doc)
        python = True
    except ValidationError:
        python = False
    return python, cel.validate(doc).accepted


@pytest.mark.parametrize(
    ("model", "ok"),
    [
        ({"path": "/models/Qwen2.5-3B"}, True),
        ({"path": "./qwen"}, True),
        ({"path": "Qwen/Qwen2.5-3B-Instruct"}, True),  # a hub id: fetched by an init container
        ({"path": "gpt2", "revision": "v1.0"}, True),
        ({"path": "Qwen/Qwen3-0.6B", "hub": {"endpoint": "https://hf-mirror.com"}}, True),
        ({"path": "Qwen/Qwen3-0.6B", "hub": {"endpoint": "ftp://mirror"}}, False),
        ({"path": "Qwen/Qwen3-0.6B", "revision": "main; rm -rf /"}, False),
        # revision and hub say where a hub id comes from: on a folder they would be ignored
        ({"path": "/models/Qwen2.5-3B", "revision": "main"}, False),
        ({"path": "runs/models/qwen", "hub": {"endpoint": "https://hf-mirror.com"}}, False),
        ({"path": "./qwen", "hub": {"tokenSecret": {"name": "hf", "key": "token"}}}, False),
    ],
)
def test_model_path_is_a_folder_or_a_hub_id_and_hub_settings_need_a_hub_id(model, ok, cel):
    assert verdicts(with_spec("model", model), cel) == (ok, ok)


def test_the_hub_id_pattern_is_the_fetchers():
    """api (the CRD's CEL, validate) and lorarl.hub (the init container) read ids alike."""
    from lorarl import hub
    from lorarl.api.spec import job

    assert hub.HUB_ID_PATTERN == job.HUB_ID_PATTERN


@pytest.mark.parametrize(
    ("section", "value", "ok"),
    [
        ("algorithm", {"gamma": 1.0, "lam": 0.95}, True),  # the defaults, spelled out
        ("algorithm", {"gamma": 0.99}, False),
        ("algorithm", {"lam": 1.0}, False),
        ("algorithm", {"name": "ppo", "gamma": 0.99, "lam": 1.0}, True),  # GAE's settings
        ("algorithm", {"name": "rloo", "lam": 0.9}, False),
        ("trainer", {"fsdp": {"reshardAfterForward": True}}, True),
        ("trainer", {"fsdp": {"reshardAfterForward": False}}, False),
        ("training", {"export": ["adapter", "merged"]}, True),
        ("training", {"export": ["merged"]}, False),
        ("training", {"export": ["gguf"]}, False),
        ("model", {"path": "/m", "trustRemoteCode": True}, True),  # passed to the trainer too
    ],
)
def test_ignored_fields_are_refused_and_supported_ones_kept(section, value, ok, cel):
    assert verdicts(with_spec(section, value), cel) == (ok, ok)


def test_chat_template_kwargs_are_kept_as_written():
    doc = with_spec("data", {"chatTemplateKwargs": {"enable_thinking": False, "x": [1]}})
    spec = LoRARLJob.model_validate(doc).spec
    assert spec.data.chat_template_kwargs == {"enable_thinking": False, "x": [1]}
    assert LoRARLJob.model_validate(LoRARLJob.model_validate(doc).wire()) == LoRARLJob(**doc)


PPO_FULL = {
    "algorithm": {
        "name": "ppo",
        "groupSize": 1,
        "gamma": 0.99,
        "lam": 0.9,
        "kl": {"coef": 0.05, "inReward": True, "controller": "adaptive", "targetKl": 0.05,
               "horizon": 5000, "estimator": "k1"},
    },
    "critic": {
        "lora": {"rank": 8, "alpha": 16, "targetModules": ["q_proj", "v_proj"],
                 "excludeModules": ["o_proj"], "useRslora": True},
        "optim": {"lr": 3e-4, "betas": [0.9, 0.95], "weightDecay": 0.01, "warmupSteps": 5,
                  "scheduler": "cosine", "gradClip": 0.5},
        "valueClip": 0.2,
        "warmupSteps": 3,
        "vfCoef": 0.5,
    },
}  # fmt: skip


def _cel_rules(node) -> dict[str, dict]:
    out: dict[str, dict] = {}
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            out[rule["rule"]] = rule
        for value in node.values():
            out |= _cel_rules(value)
    elif isinstance(node, list):
        for value in node:
            out |= _cel_rules(value)
    return out


CEL_RULES = _cel_rules(crd())


def with_specs(**sections: dict) -> dict:
    doc = copy.deepcopy(MINIMAL)
    doc["spec"].update(copy.deepcopy(sections))
    return doc


def test_a_full_ppo_spec_is_accepted_by_both(cel):
    doc = with_specs(**PPO_FULL)
    assert verdicts(doc, cel) == (True, True)
    spec = LoRARLJob.model_validate(doc).spec
    assert (spec.critic.lora.rank, spec.critic.optim.lr, spec.critic.value_clip) == (8, 3e-4, 0.2)
    assert (spec.algorithm.kl.in_reward, spec.algorithm.kl.horizon) == (True, 5000)
    assert verdicts(with_specs(algorithm={"name": "ppo"}, critic={}), cel) == (True, True)


def _ppo(**kl) -> dict:
    return {"name": "ppo", "kl": kl}


@pytest.mark.parametrize(
    ("sections", "field", "words"),
    [
        ({"critic": {}}, "spec.critic", "used by ppo only"),
        ({"algorithm": {"name": "rloo"}, "critic": {"vfCoef": 0.5}}, "spec.critic", "ppo only"),
        ({"algorithm": {"name": "ppo"}, "critic": {"warmupSteps": 100}},
         "spec.critic.warmupSteps", "less than training.totalSteps"),
        ({"algorithm": {"name": "ppo"}, "critic": {"lora": {"targetModules": ["all-linear", "x"]}}},
         "spec.critic.lora.targetModules", "'all-linear' cannot be combined"),
        ({"algorithm": {"kl": {"coef": 0.1, "inReward": True}}},
         "spec.algorithm.kl.inReward", "only ppo (GAE) uses"),
        ({"algorithm": _ppo(inReward=True)}, "spec.algorithm.kl.inReward", "coef is 0"),
        ({"algorithm": _ppo(coef=0.1, controller="adaptive")},
         "spec.algorithm.kl.controller", "with inReward only"),
        ({"algorithm": _ppo(coef=0.1, inReward=True, targetKl=0.3)},
         "spec.algorithm.kl.targetKl", "adaptive KL controller only"),
        ({"algorithm": _ppo(coef=0.1, inReward=True, horizon=10)},
         "spec.algorithm.kl.horizon", "adaptive KL controller only"),
        ({"algorithm": {"name": "dapo", "gamma": 0.9}}, "spec.algorithm.gamma", "GAE (ppo) only"),
        ({"algorithm": {"name": "reinforce_pp", "lam": 0.9}}, "spec.algorithm.lam",
         "GAE (ppo) only"),
    ],
)  # fmt: skip
def test_each_ppo_rule_refuses_naming_its_field_in_both(sections, field, words, cel):
    doc = with_specs(**sections)
    problems = [str(p) for p in check_manifest(doc)]
    assert len(problems) == 1 and problems[0].startswith(f"{field}: "), problems
    assert words in problems[0]
    # the API server's answer: the one failing CEL rule, reported on the same field with the
    # same message
    verdict = cel.validate(doc)
    assert verdict.status == 422, verdict.message
    (cause,) = verdict.body["details"]["causes"]
    assert cause["field"] == field, cause
    messages = {r["message"] for r in CEL_RULES.values() if r["message"] in cause["message"]}
    assert messages and all(m in problems[0] for m in messages), (messages, problems)


@pytest.mark.parametrize(
    "sections",
    [
        {"algorithm": {"name": "ppo"}, "critic": {"warmupSteps": 99}},
        {"algorithm": {"name": "ppo"}, "critic": {"lora": {"targetModules": ["all-linear"]}}},
        {"algorithm": _ppo(coef=0.1, inReward=True, controller="fixed")},
        {"algorithm": _ppo(coef=0.1, controller="fixed", targetKl=0.1, horizon=10000)},
        {"algorithm": _ppo(coef=0.1, inReward=True, controller="adaptive", targetKl=1.0)},
        {"algorithm": {"kl": {"coef": 0.1, "inReward": False}}},
    ],
)
def test_the_boundaries_of_the_ppo_rules_are_accepted_by_both(sections, cel):
    assert verdicts(with_specs(**sections), cel) == (True, True)
