"""Issue 34, finding 4: one job could use another job's Secrets and output, and reach nodes and
peers it should not. A manifest that passed `lorarl validate` rendered a trainer pod reading
another job's `<job>-engine-key`, writing to that job's outputDir on its claim, and tolerating
control-plane nodes; the trainer resumed from and pruned whatever checkpoints it found; the
job's NetworkPolicy admitted any pod carrying the job's name label.

Each refusal goes through `lorarl validate` (the CLI) and the webhook's own handler functions;
the checkpoint rules through a real CheckpointManager; the selector through the operator's own
builders and reconcile pass.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import kopf
import pytest
import torch
import yaml
from click.testing import CliRunner

from harness.workloads.tiny_models import make_tiny_model
from lorarl.api import LoRARLJob
from lorarl.api.validation import ManifestError
from lorarl.cli.main import main
from lorarl.operator import builders
from lorarl.operator.config import OperatorConfig
from lorarl.operator.handlers import webhook
from lorarl.operator.parsing import job_from_body
from lorarl.operator.reconciler import Reconciler
from lorarl.plan import plan
from lorarl.trainer.checkpoint.manager import CheckpointError, CheckpointManager
from lorarl.trainer.model.loading import LoraSettings, apply_lora, load_base_model, lora_parameters

ROOT = Path(__file__).resolve().parents[2]
JOB: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
NAME = JOB["metadata"]["name"]
MAX_OUTPUT = 1000  # bytes: a refusal is one short line per problem


def edited(**spec: Any) -> dict[str, Any]:
    """The quickstart with each `a__b=value` set at spec.a.b."""
    doc = copy.deepcopy(JOB)
    for dotted, value in spec.items():
        node = doc["spec"]
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return doc


def secret_env(name: str) -> list[dict[str, Any]]:
    return [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": "api-key"}}}]


def validate(tmp_path: Path, doc: dict[str, Any], *options: str) -> tuple[int, str]:
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    r = CliRunner().invoke(main, ["validate", *options, str(f)])
    assert len(r.output.encode()) < MAX_OUTPUT, r.output
    return r.exit_code, r.output


def webhook_says(doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch, **config: Any) -> str:
    """The webhook's refusal with the operator's config changed by `config` ('' if admitted)."""
    monkeypatch.setattr(webhook, "CONFIG", dataclasses.replace(webhook.CONFIG, **config))
    try:
        webhook.validate_lorarljob(body=copy.deepcopy(doc), old=None, operation="CREATE")
    except kopf.AdmissionError as exc:
        assert len(str(exc).encode()) < MAX_OUTPUT
        return str(exc)
    return ""


# --- another job's generated Secret -----------------------------------------------------------

FOREIGN = [
    ("trainer__env", "spec.trainer.env[0].valueFrom.secretKeyRef.name"),
    ("rollout__env", "spec.rollout.env[0].valueFrom.secretKeyRef.name"),
]


@pytest.mark.parametrize(("where", "field"), FOREIGN)
def test_another_jobs_engine_key_is_refused_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, field: str
) -> None:
    doc = edited(**{where: secret_env("victim-engine-key")})
    code, out = validate(tmp_path, doc, "--allowed-secrets", "*")
    assert code == 1
    assert f"{field}: must not name another job's Secret" in out and "victim-engine-key" in out
    # Even an allow-list of every Secret does not grant another job's keys.
    said = webhook_says(doc, monkeypatch, allowed_secrets=("*",))
    assert said.startswith(f"{field}: must not name another job's Secret"), said
    # The operator with the webhook off fails the job before it creates anything.
    with pytest.raises(ManifestError, match="another job's Secret"):
        job_from_body(doc)


def test_a_tracker_credential_from_another_jobs_secret_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = {"name": "victim-engine-key", "key": "sync-key"}
    doc = edited(logging={"backends": ["wandb"], "wandb": {"apiKeySecret": ref}})
    field = "spec.logging.wandb.apiKeySecret.name"
    code, out = validate(tmp_path, doc)
    assert code == 1 and f"{field}: must not name another job's Secret" in out
    assert webhook_says(doc, monkeypatch).startswith(field)


def test_a_job_may_read_its_own_generated_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = edited(trainer__env=secret_env(f"{NAME}-engine-key"))
    code, out = validate(tmp_path, doc, "--allowed-secrets", "")
    assert (code, out.strip()) == (0, f"{tmp_path / 'job.yaml'}: ok ({NAME})")
    assert webhook_says(doc, monkeypatch, allowed_secrets=()) == ""
    assert job_from_body(doc).name == NAME


# --- the admin's Secret allow-list ------------------------------------------------------------


def test_secrets_follow_the_operators_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = edited(trainer__env=secret_env("hf-token"))
    doc["metadata"]["namespace"] = "team-a"
    field = "spec.trainer.env[0].valueFrom.secretKeyRef.name"
    said = webhook_says(doc, monkeypatch, allowed_secrets=())
    assert said == (
        f"{field}: must be a Secret the operator lets jobs read (the chart's "
        'webhook.allowedSecrets) (got "hf-token")'
    )
    for allowed in (("hf-token",), ("team-a/hf-token",), ("team-a/*",), ("*",)):
        assert webhook_says(doc, monkeypatch, allowed_secrets=allowed) == "", allowed
    for other in (("team-b/hf-token",), ("team-b/*",), ("hf",)):
        assert webhook_says(doc, monkeypatch, allowed_secrets=other).startswith(field), other


def test_validate_checks_the_allow_list_it_is_given(tmp_path: Path) -> None:
    """Offline, the cluster's list is unknown: no --allowed-secrets, no check."""
    doc = edited(trainer__env=secret_env("hf-token"))
    assert validate(tmp_path, doc)[0] == 0
    code, out = validate(tmp_path, doc, "--allowed-secrets", "wandb,research/*")
    assert code == 1
    assert "spec.trainer.env[0].valueFrom.secretKeyRef.name: must be a Secret the operator" in out
    assert validate(tmp_path, doc, "--allowed-secrets", "wandb,hf-token")[0] == 0
    code, out = validate(tmp_path, doc, "--allowed-secrets", "a/b/c")
    assert code == 2 and "--allowed-secrets" in out


def test_the_allow_list_reaches_the_operator_from_its_environment() -> None:
    config = OperatorConfig.from_env({"LORARL_ALLOWED_SECRETS": "wandb, team-a/*"})
    assert config.tenancy.allowed_secrets == ("wandb", "team-a/*")
    assert OperatorConfig.from_env({}).tenancy.allowed_secrets == ()
    with pytest.raises(ValueError, match="LORARL_ALLOWED_SECRETS: 'Bad_Name'"):
        OperatorConfig.from_env({"LORARL_ALLOWED_SECRETS": "Bad_Name"})


# --- control-plane nodes ----------------------------------------------------------------------

CONTROL_PLANE = [
    ("trainer__nodeSelector", {"node-role.kubernetes.io/control-plane": ""},
     "spec.trainer.nodeSelector: must not select control-plane nodes"),
    ("rollout__nodeSelector", {"node-role.kubernetes.io/master": "true"},
     "spec.rollout.nodeSelector: must not select control-plane nodes"),
    ("trainer__tolerations", [{"key": "node-role.kubernetes.io/control-plane",
                               "operator": "Exists", "effect": "NoSchedule"}],
     "spec.trainer.tolerations[0]: must not tolerate the control-plane taint"),
    ("rollout__tolerations", [{"key": "gpu", "operator": "Exists"},
                              {"key": "node-role.kubernetes.io/master", "value": ""}],
     "spec.rollout.tolerations[1]: must not tolerate the control-plane taint"),
    ("trainer__tolerations", [{"operator": "Exists"}],  # tolerates every taint
     "spec.trainer.tolerations[0]: must not tolerate the control-plane taint"),
]  # fmt: skip


@pytest.mark.parametrize(("where", "value", "expected"), CONTROL_PLANE)
def test_control_plane_nodes_are_refused_unless_the_chart_allows_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, value: Any, expected: str
) -> None:
    doc = edited(**{where: value})
    code, out = validate(tmp_path, doc)
    assert code == 1 and expected in out, out
    assert webhook_says(doc, monkeypatch).startswith(expected)
    assert validate(tmp_path, doc, "--allow-control-plane-nodes")[0] == 0
    assert webhook_says(doc, monkeypatch, allow_control_plane_nodes=True) == ""


def test_tolerations_that_cannot_reach_the_control_plane_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control-plane taint is NoSchedule: a key-less Exists for NoExecute only, or other
    keys, do not tolerate it (the spot pools' tolerations, a GPU taint)."""
    doc = edited(
        trainer__tolerations=[
            {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        ],
        trainer__nodeSelector={"node-role.kubernetes.io/worker": ""},
    )
    assert validate(tmp_path, doc)[0] == 0
    assert webhook_says(doc, monkeypatch) == ""


def test_the_control_plane_flag_reaches_the_operator_from_its_environment() -> None:
    assert OperatorConfig.from_env({}).allow_control_plane_nodes is False
    env = {"LORARL_ALLOW_CONTROL_PLANE_NODES": "true"}
    assert OperatorConfig.from_env(env).tenancy.allow_control_plane_nodes is True
    with pytest.raises(ValueError, match="LORARL_ALLOW_CONTROL_PLANE_NODES: must be true or"):
        OperatorConfig.from_env({"LORARL_ALLOW_CONTROL_PLANE_NODES": "yes"})


# --- another live job's outputDir -------------------------------------------------------------


class Lister:
    """The webhook's API client: answers the namespace's LoRARLJob list, records each call."""

    def __init__(self, items: list[dict[str, Any]], error: Exception | None = None) -> None:
        self.items, self.error, self.calls = items, error, []

    async def get(self, url: str) -> dict[str, Any]:
        self.calls.append(url)
        if self.error is not None:
            raise self.error
        return {"kind": "LoRARLJobList", "items": copy.deepcopy(self.items)}


def other_job(
    name: str,
    output_dir: str,
    *,
    claim: str = "lorarl-outputs",
    mount: str = "/outputs",
    phase: str | None = "Running",
    deleting: bool = False,
) -> dict[str, Any]:
    """Another job of the namespace, as the API server lists it."""
    doc = edited(training__outputDir=output_dir)
    doc["spec"]["training"]["volume"] = {"claimName": claim, "mountPath": mount}
    doc["metadata"] = {"name": name, "namespace": "default", "uid": f"uid-{name}"}
    if deleting:
        doc["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if phase is not None:
        doc["status"] = {"phase": phase}
    return doc


def admit(doc: dict[str, Any], kube: Lister, old: dict[str, Any] | None = None) -> str:
    """The registered handler, end to end ('' if admitted)."""
    operation = "UPDATE" if old is not None else "CREATE"
    try:
        asyncio.run(
            webhook.admit_lorarljob(
                body=copy.deepcopy(doc), old=old, operation=operation, memo={"kube": kube}
            )
        )
    except kopf.AdmissionError as exc:
        return str(exc)
    return ""


MINE = edited()  # outputDir /outputs/quickstart on claim lorarl-outputs, mounted at /outputs
MINE["metadata"]["namespace"] = "default"


@pytest.mark.parametrize(
    "other",
    [
        other_job("victim", "/outputs/quickstart"),  # the same folder
        other_job("victim", "/outputs/quickstart/", mount="/outputs/"),  # spelled differently
        other_job("victim", "/data/quickstart", mount="/data"),  # mounted elsewhere
        other_job("victim", "/outputs"),  # its folder holds this one
        other_job("victim", "/outputs/quickstart/inner"),  # this one holds its folder
        other_job("victim", "/outputs/x/../quickstart", phase=None),  # not started yet
        other_job("victim", "/outputs/quickstart", phase="Suspended"),
    ],
)
def test_an_outputdir_another_live_job_uses_is_refused(other: dict[str, Any]) -> None:
    kube = Lister([other, other_job("finished", "/outputs/quickstart", phase="Succeeded")])
    said = admit(MINE, kube)
    assert said == (
        'spec.training.outputDir: overlaps the outputDir of live job "victim" on claim '
        '"lorarl-outputs": each job needs a folder of its own (its checkpoints are resumed and '
        "pruned there)"
    )
    assert kube.calls == ["/apis/lorarl.dev/v1alpha1/namespaces/default/lorarljobs"]


@pytest.mark.parametrize(
    "other",
    [
        other_job("done", "/outputs/quickstart", phase="Succeeded"),
        other_job("failed", "/outputs/quickstart", phase="Failed"),
        other_job("going", "/outputs/quickstart", deleting=True),
        other_job("elsewhere", "/outputs/quickstart", claim="other-claim"),
        other_job("sibling", "/outputs/quickstart-2"),
        other_job(NAME, "/outputs/quickstart"),  # this job itself, as listed
    ],
)
def test_folders_no_live_job_writes_to_are_admitted(other: dict[str, Any]) -> None:
    assert admit(MINE, Lister([other])) == ""


def test_only_a_moved_outputdir_is_checked_again_on_update() -> None:
    """kopf patches its annotations on every job every few seconds: those updates list nothing."""
    kube = Lister([other_job("victim", "/outputs/quickstart")])
    suspended = copy.deepcopy(MINE)
    suspended["spec"]["runPolicy"] = {"suspend": True}
    old = copy.deepcopy(suspended)
    old["spec"]["training"]["outputDir"] = "/outputs/elsewhere"
    assert admit(suspended, kube, old=suspended) == "" and kube.calls == []
    assert admit(suspended, kube, old=old).startswith("spec.training.outputDir: overlaps")


def test_an_unreadable_job_list_refuses_rather_than_admits() -> None:
    from lorarl.operator.kube import KubeError

    said = admit(MINE, Lister([], error=KubeError(None, "Unreachable", "GET: no answer")))
    assert said.startswith("spec.training.outputDir: could not be checked against the other jobs")


def test_a_manifest_refused_by_the_static_rules_lists_nothing() -> None:
    """A refusal changes nothing and costs no API call."""
    kube = Lister([])
    said = admit(edited(trainer__env=secret_env("victim-engine-key")), kube)
    assert "another job's Secret" in said and kube.calls == []


# --- checkpoints carry the job's UID ----------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama")


def _model(model_dir: Path) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = apply_lora(load_base_model(model_dir), LoraSettings(rank=4, alpha=8))
    return model, torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-2)


def test_checkpoints_record_the_job_uid(model_dir: Path, tmp_path: Path) -> None:
    path = CheckpointManager(tmp_path, job_uid="uid-a").save(1, *_model(model_dir), {})
    assert json.loads((path / "state.json").read_text())["job_uid"] == "uid-a"


def test_resuming_from_another_jobs_checkpoint_is_refused(model_dir: Path, tmp_path: Path) -> None:
    model, opt = _model(model_dir)
    theirs = CheckpointManager(tmp_path, job_uid="uid-victim").save(5, model, opt, {})
    mine = CheckpointManager(tmp_path, job_uid="uid-mine")
    expected = re.escape("written by job UID uid-victim, not by this job (UID uid-mine): refusing")
    with pytest.raises(CheckpointError, match=expected):
        mine.latest()
    with pytest.raises(CheckpointError, match=expected):
        mine.latest_shared()  # what the trainer calls: the refusal reaches every rank
    with pytest.raises(CheckpointError, match=expected):
        mine.load(theirs, *_model(model_dir))
    assert CheckpointManager(tmp_path, job_uid="uid-victim").latest().path == theirs


def test_pruning_never_deletes_another_jobs_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    model, opt = _model(model_dir)
    victim = CheckpointManager(tmp_path, keep_last=3, job_uid="uid-victim")
    theirs = [victim.save(step, model, opt, {}) for step in (1, 2)]
    mine = CheckpointManager(tmp_path, keep_last=1, job_uid="uid-mine")
    with pytest.raises(CheckpointError, match=r"uid-victim.*uid-mine.*refusing to delete"):
        mine.save(3, model, opt, {})
    assert all(p.is_dir() and victim.verify(p) is None for p in theirs)
    # Nor is one replaced by a checkpoint of the same step.
    with pytest.raises(CheckpointError, match="refusing to replace"):
        mine.save(2, model, opt, {})
    assert victim.verify(theirs[1]) is None and victim.owner(theirs[1]) == "uid-victim"


def test_a_jobs_own_checkpoints_resume_and_prune_as_before(model_dir: Path, tmp_path: Path) -> None:
    model, opt = _model(model_dir)
    mgr = CheckpointManager(tmp_path, keep_last=1, job_uid="uid-a")
    for step in (1, 2):
        mgr.save(step, model, opt, {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    again = CheckpointManager(tmp_path, keep_last=1, job_uid="uid-a")  # a restarted trainer
    assert again.latest_shared().step == 2
    assert again.load(again.latest(), *_model(model_dir)).trainer_state == {"step": 2}


def test_a_checkpoint_without_a_uid_is_taken_with_a_warning(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written before checkpoints carried one: a job running across the upgrade resumes."""
    model, opt = _model(model_dir)
    old = CheckpointManager(tmp_path).save(4, model, opt, {"step": 4})
    assert "job_uid" not in json.loads((old / "state.json").read_text())
    mgr = CheckpointManager(tmp_path, keep_last=1, job_uid="uid-a")
    with caplog.at_level(logging.WARNING, logger="lorarl.trainer.checkpoint.manager"):
        assert mgr.latest().path == old
    assert "records no job UID" in caplog.text and "uid-a" in caplog.text
    mgr.save(5, model, opt, {})
    assert not old.exists()  # taken as this job's, it is pruned like one


# --- the NetworkPolicy admits the job's pods by its uid ---------------------------------------


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_the_network_policy_admits_this_jobs_pods_by_uid_not_by_name() -> None:
    job = LoRARLJob.model_validate(JOB)
    job_plan = plan(job)
    policy = builders.network_policy(job_plan, "lorarl-system", job_uid="uid-now")
    selector = policy["spec"]["podSelector"]
    assert selector["matchLabels"][builders.JOB_UID_LABEL] == "uid-now"
    assert policy["spec"]["ingress"][0]["from"] == [{"podSelector": selector}]
    ours = builders.pod(job_plan, job, "trainer", 0, job_uid="uid-now")
    assert selects(selector, ours["metadata"]["labels"])
    env = {e["name"]: e.get("value") for e in ours["spec"]["containers"][0]["env"]}
    assert env["LORARL_JOB_UID"] == "uid-now"
    # A pod of the job that had this name before (or one copied from its manifest) is not a peer.
    earlier = builders.pod(job_plan, job, "rollout", 0, job_uid="uid-before")
    assert not selects(selector, earlier["metadata"]["labels"])
    name_only = {builders.JOB_LABEL: NAME, builders.MANAGED_BY[0]: builders.MANAGED_BY[1]}
    assert not selects(selector, name_only)  # what the old policy admitted


class Recorder:
    """The operator's API client: every create answered as the API server would."""

    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.created.append(obj)
        made = copy.deepcopy(obj)
        made["metadata"]["uid"] = f"uid-of-{obj['metadata']['name']}"
        return made

    async def merge_patch(self, url: str, body: dict[str, Any], *, what: str) -> dict[str, Any]:
        return body


def test_the_reconciler_labels_pods_and_the_policy_with_the_jobs_uid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    body = copy.deepcopy(JOB)
    body["metadata"].update(namespace="default", uid="0b5c-job-uid", generation=1)
    kube = Recorder()
    reconciler = Reconciler(kube=kube, config=OperatorConfig())  # type: ignore[arg-type]
    asyncio.run(reconciler.reconcile(body, [], trigger="create"))
    (policy,) = [o for o in kube.created if o["kind"] == "NetworkPolicy"]
    pods = [o for o in kube.created if o["kind"] == "Pod"]
    assert len(pods) == 3  # the quickstart's trainer and two rollout pods
    assert policy["spec"]["podSelector"]["matchLabels"][builders.JOB_UID_LABEL] == "0b5c-job-uid"
    for pod in pods:
        assert selects(policy["spec"]["podSelector"], pod["metadata"]["labels"])
        for container in pod["spec"]["containers"]:
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["LORARL_JOB_UID"] == "0b5c-job-uid"


def test_a_manifest_cannot_set_the_job_uid_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = edited(trainer__env=[{"name": "LORARL_JOB_UID", "value": "uid-victim"}])
    assert "spec.trainer.env: must not set reserved variables" in webhook_says(doc, monkeypatch)
