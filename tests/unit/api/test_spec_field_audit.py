"""The spec field audit (docs/spec-fields.md) stays true: every field has a row, and the
behaviours the audit added hold (cluster-only fields named by a local run, no GPU for a
gpusPerReplica-0 replica, the wiring of fields no other test reaches)."""

from __future__ import annotations

import re
import time
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from rich.console import Console

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec import k8s
from lorarl.api.spec.job import LoRARLJobSpec
from lorarl.api.spec.tracking import tracking_env
from lorarl.api.validation import check_manifest, load_job_file
from lorarl.local import LocalRun, session
from lorarl.local.cluster_fields import CLUSTER_ONLY, local_warning, set_cluster_fields
from lorarl.local.runner import RunFailed
from lorarl.plan import LocalAddressing, plan
from lorarl.plan.engines import engine_env
from lorarl.trainer.settings import ConfigError, reward_service_client

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "spec-fields.md"
# Reusable Kubernetes types get one row per field ("Toleration.key"), not one per place used.
K8S_TYPES = (
    k8s.ResourceRequirements,
    k8s.Toleration,
    k8s.EnvVar,
    k8s.EnvVarSource,
    k8s.SecretKeySelector,
    k8s.VolumeClaim,
)
MINIMAL = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "audit"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models(a)]


def spec_fields() -> set[str]:
    out: set[str] = set()
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            path = prefix + (info.alias or name)
            out.add(path)
            for sub in _models(info.annotation):
                if sub not in K8S_TYPES:
                    walk(sub, f"{path}.")
                elif sub not in seen:
                    seen.add(sub)
                    walk(sub, f"{sub.__name__}.")

    walk(LoRARLJobSpec, "")
    return out


def table_rows() -> list[str]:
    return re.findall(r"^\| `([A-Za-z.]+)` \|", DOC.read_text(), flags=re.M)


def test_every_spec_field_has_exactly_one_row_in_the_audit():
    rows = table_rows()
    fields = spec_fields()
    assert len(fields) > 150  # the walk reached the nested sections
    assert sorted(fields - set(rows)) == [], "add these fields to docs/spec-fields.md"
    assert sorted(set(rows) - fields) == [], "docs/spec-fields.md lists fields that are gone"
    assert len(rows) == len(set(rows)), "a field has two rows"


def test_cluster_only_fields_are_spec_fields_and_say_so_in_the_audit():
    text = DOC.read_text()
    fields = spec_fields()
    for path in CLUSTER_ONLY:
        assert path in fields, path
        row = re.search(rf"^\| `{re.escape(path)}` \|(.*)$", text, flags=re.M).group(1)
        section = path.split(".")[0]
        assert "local" in row or section in ("runPolicy", "scheduling"), path


def _job(**spec) -> LoRARLJob:
    doc = {**MINIMAL, "spec": {**MINIMAL["spec"], **spec}}
    return LoRARLJob.model_validate(doc)


def test_a_local_run_names_the_cluster_only_fields_a_job_sets():
    assert local_warning(_job()) is None
    job = _job(
        scheduling={"gang": "volcano"},
        trainer={"tolerations": [{"key": "gpu", "operator": "Exists"}]},
        runPolicy={"activeDeadlineSeconds": 60},
    )
    assert set_cluster_fields(job) == [
        "trainer.tolerations",
        "runPolicy.activeDeadlineSeconds",
        "scheduling.gang",
    ]
    quickstart = load_job_file(ROOT / "examples" / "quickstart.yaml")
    line = local_warning(quickstart)
    assert "spec.training.volume" in line and "spec.training.outputDir" in line
    assert "spec.scheduling" not in line and "\n" not in line


def test_run_local_prints_the_warning_once(monkeypatch, tmp_path):
    class StoppedRun:
        def __init__(self, job, run_dir, **kw):
            self.run_dir = Path(run_dir)

        def start(self):
            pass

        def wait(self, **kw):
            raise RunFailed("stopped by the test")

        def stop(self):
            pass

    monkeypatch.setattr(session, "check_inputs", lambda job: None)
    monkeypatch.setattr(session, "find_engine_python", lambda path, module: "python")
    monkeypatch.setattr(session, "LocalRun", StoppedRun)
    console = Console(record=True, width=400)
    job = _job(scheduling={"queueName": "team"}, trainer={"image": "registry/t:1"})
    code = session.run_local(job, run_dir=str(tmp_path), status_port=-1, console=console)
    out = console.export_text()
    assert code == 1
    assert out.count("not used by a local run") == 1
    assert "spec.trainer.image, spec.scheduling.queueName" in out


def _children(tmp_path: Path, job: LoRARLJob) -> dict:
    run = LocalRun(job, tmp_path / "run")
    run.run_dir.mkdir(parents=True)
    run.plan = plan(run.job, LocalAddressing(30000))
    return {
        f"{r.role}-{c.name}": run._child(r, c)
        for role in run.plan.roles
        for r in role.replicas
        for c in r.containers
    }


def test_zero_gpu_replicas_see_no_gpu_locally(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cpu = _job(trainer={"gpusPerReplica": 0}, rollout={"engine": "vllm", "gpusPerReplica": 0})
    children = _children(tmp_path / "cpu", cpu)
    for name in ("trainer-trainer", "rollout-engine", "rollout-sidecar"):
        assert children[name].env["CUDA_VISIBLE_DEVICES"] == "", name
    gpu = _job(trainer={"gpusPerReplica": 1}, rollout={"engine": "vllm", "gpusPerReplica": 1})
    children = _children(tmp_path / "gpu", gpu)
    assert children["trainer-trainer"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert children["rollout-engine"].env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_an_optional_secret_is_skipped_locally_and_a_required_one_stops_the_run(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("TOKEN_A", raising=False)
    ref = {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}
    optional = _job(trainer={"gpusPerReplica": 0, "env": [{"name": "TOKEN_A", "valueFrom": ref}]})
    assert "TOKEN_A" not in _children(tmp_path / "a", optional)["trainer-trainer"].env
    required = {"secretKeyRef": {"name": "s", "key": "k"}}
    job = _job(trainer={"gpusPerReplica": 0, "env": [{"name": "TOKEN_A", "valueFrom": required}]})
    with pytest.raises(RunFailed, match="TOKEN_A comes from Secret 's'"):
        _children(tmp_path / "b", job)


def test_images_seed_and_lengths_reach_the_containers():
    job = _job(
        trainer={"image": "reg/trainer:x"},
        rollout={"engine": "vllm", "gpusPerReplica": 1, "image": "reg/engine:y"},
        training={"seed": 1234},
        data={"trainFiles": ["t.jsonl"], "maxPromptTokens": 100, "maxResponseTokens": 28},
    )
    p = plan(job)
    assert p.role("trainer").replicas[0].containers[0].image == "reg/trainer:x"
    engine, sidecar = p.role("rollout").replicas[0].containers
    assert engine.image == sidecar.image == "reg/engine:y"
    argv = engine.command
    assert argv[argv.index("--seed") + 1] == "1234"
    assert argv[argv.index("--max-model-len") + 1] == "128"
    # Multi-turn: the context holds the prompt and the whole episode, not one reply.
    episodes = _job(
        rollout={"engine": "vllm", "gpusPerReplica": 1},
        data={"trainFiles": ["t.jsonl"], "maxPromptTokens": 100, "maxResponseTokens": 28},
        environment={"entrypoint": "tool_calling", "maxTotalTokens": 400},
    )
    argv = plan(episodes).role("rollout").replicas[0].containers[0].command
    assert argv[argv.index("--max-model-len") + 1] == "500"
    sglang = plan(_job(rollout={"engine": "sglang"}, training={"seed": 99}))
    argv = sglang.role("rollout").replicas[0].containers[0].command
    assert argv[argv.index("--random-seed") + 1] == "99"


def test_kv_cache_reaches_the_cpu_engine():
    spec = _job(rollout={"engine": "vllm", "gpusPerReplica": 0, "kvCacheGib": 6}).spec
    assert engine_env(spec)["VLLM_CPU_KVCACHE_SPACE"] == "6"


def test_each_mlflow_credential_becomes_a_secret_ref_on_the_trainer():
    sel = {"name": "mlflow", "key": "x"}
    spec = _job(
        logging={
            "backends": ["mlflow"],
            "mlflow": {
                "trackingUri": "http://mlflow:5000",
                "usernameSecret": {**sel, "key": "user"},
                "passwordSecret": {**sel, "key": "pass"},
            },
        }
    ).spec
    refs = {e.name: e.value_from.secret_key_ref.key for e in tracking_env(spec)}
    assert refs == {"MLFLOW_TRACKING_USERNAME": "user", "MLFLOW_TRACKING_PASSWORD": "pass"}


@pytest.mark.parametrize(
    ("spec", "refused_field"),
    [
        ({"rollout": {"engine": "vllm", "gpusPerReplica": 0, "memoryFraction": 0.85}}, None),
        ({"rollout": {"engine": "vllm", "gpusPerReplica": 0, "memoryFraction": 0.5}},
         "memoryFraction"),
        ({"rollout": {"engine": "vllm", "gpusPerReplica": 1, "memoryFraction": 0.5}}, None),
        ({"rollout": {"engine": "vllm", "gpusPerReplica": 0, "kvCacheGib": 4}}, None),
        ({"rollout": {"engine": "sglang", "gpusPerReplica": 1, "kvCacheGib": 4}}, "kvCacheGib"),
        ({"rollout": {"engine": "sglang", "gpusPerReplica": 0}}, "gpusPerReplica"),
        ({"reward": {"function": "exact_match", "service": {"url": "http://r:8000"}}}, None),
        ({"reward": {"function": "exact_match", "service": {"url": "http://r:8000",
          "resources": {"limits": {"cpu": 2}}}}}, "reward.service"),
        ({"reward": {"function": "exact_match", "service": {"maxReplicas": 2}}}, None),
        ({"reward": {"function": "exact_match", "service": {"replicas": 3, "maxReplicas": 2}}},
         "maxReplicas"),
        ({"training": {"volume": {"claimName": "o", "mountPath": "/o", "readOnly": True}}},
         "readOnly"),
        ({"reward": {"function": "regex_match", "params": {"pattern": "a"},
          "service": {"url": "http://r:8000"}}}, "reward.params"),
        ({"reward": {"function": "regex_match", "params": {"pattern": "a"}, "service": {}}},
         None),
        ({"data": {"trainFiles": ["t.jsonl"], "valFiles": ["v.jsonl"]}}, "data.valFiles"),
        ({"data": {"trainFiles": ["t.jsonl"], "valFiles": ["v.jsonl"]},
          "training": {"evalBeforeTrain": True}}, None),
        ({"training": {"eval": {"maxPrompts": 10}}}, "training.eval"),
        ({"training": {"eval": {"n": 1, "temperature": 0.0}}}, None),  # the defaults, spelled out
        ({"algorithm": {"kl": {"estimator": "k2"}}}, "kl.estimator"),
        ({"algorithm": {"kl": {"coef": 0.1, "estimator": "k2"}}}, None),
        ({"algorithm": {"rolloutCorrection": {"mode": "off", "threshold": 4}}}, "threshold"),
        ({"algorithm": {"rolloutCorrection": {"mode": "mask-sequence", "threshold": 4}}}, None),
        ({"algorithm": {"dynamicSampling": {"maxRounds": 5}}}, "maxRounds"),
        ({"algorithm": {"name": "dapo", "dynamicSampling": {"maxRounds": 5}}}, None),
        ({"algorithm": {"dynamicSampling": {"metric": "shaped-reward"}}}, "metric"),
        ({"algorithm": {"name": "dapo", "dynamicSampling": {"metric": "shaped-reward"}}}, None),
        ({"algorithm": {"name": "dapo", "dynamicSampling": {"metric": "shaped-reward"},
          "overlong": {"softPunishment": False}}}, "metric"),
        ({"algorithm": {"dynamicSampling": {"enabled": True, "metric": "shaped-reward"},
          "overlong": {"softPunishment": True}}}, None),
        ({"algorithm": {"name": "dapo", "dynamicSampling": {"metric": "accuracy"}}}, "metric"),
        ({"algorithm": {"overlong": {"penaltyFactor": 2}}}, "penaltyFactor"),
        ({"algorithm": {"name": "dapo", "overlong": {"penaltyFactor": 2}}}, None),
        ({"data": {"trainFiles": ["t.jsonl"], "shuffle": False, "seed": 3}}, "data.seed"),
        ({"data": {"trainFiles": ["t.jsonl"], "seed": 3}}, None),
        ({"training": {"samplesPerStep": 2}}, "samplesPerStep"),
        ({"training": {"samplesPerStep": 2, "samplesInterval": 5}}, None),
    ],
)  # fmt: skip
def test_ignored_values_are_refused_and_the_rest_accepted(spec, refused_field):
    doc = {**MINIMAL, "spec": {**MINIMAL["spec"], **spec}}
    problems = [str(p) for p in check_manifest(doc, cluster=False)]
    if refused_field is None:
        assert problems == []
    else:
        assert len(problems) == 1 and refused_field in problems[0].split(":")[0], problems


def test_placement_resources_and_images_reach_the_pods():
    from lorarl.operator import builders

    toleration = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    job = _job(
        trainer={"image": "reg/t:1", "nodeSelector": {"pool": "train"},
                 "tolerations": [toleration], "resources": {"limits": {"memory": "8Gi"}}},
        rollout={"nodeSelector": {"pool": "serve"}, "resources": {"requests": {"cpu": 2}}},
        scheduling={"priorityClassName": "batch-high"},
        reward={"function": "exact_match", "service": {"resources": {"limits": {"cpu": 3}}}},
    )  # fmt: skip
    p = plan(job)
    trainer = builders.pod(p, job, "trainer", 0)["spec"]
    assert trainer["nodeSelector"] == {"pool": "train"}
    assert trainer["tolerations"] == [toleration]
    assert trainer["priorityClassName"] == "batch-high"
    assert trainer["containers"][0]["image"] == "reg/t:1"
    assert trainer["containers"][0]["resources"]["limits"]["memory"] == "8Gi"
    rollout = builders.pod(p, job, "rollout", 0)["spec"]
    assert rollout["nodeSelector"] == {"pool": "serve"} and "tolerations" not in rollout
    assert rollout["containers"][0]["resources"]["requests"]["cpu"] == "2"
    reward = builders.pod(p, job, "reward", 0)["spec"]
    assert reward["containers"][0]["resources"]["limits"]["cpu"] == "3"


def test_the_trainers_reward_requests_name_the_specs_reward():
    """The service lorarl runs serves the reward under its function (or entrypoint) name, and an
    external one may serve several: every request names it."""
    assert reward_service_client(_job(), None) is None  # scored in-process
    service = {"url": "http://rewards:8000", "timeoutSeconds": 7, "maxRetries": 1}
    external = _job(reward={"function": "code_tests", "service": service})
    client = reward_service_client(external, None)
    assert (client.url, client.reward, client.timeout_s, client.max_retries) == (
        "http://rewards:8000",
        "code_tests",
        7,
        1,
    )
    own = _job(reward={"entrypoint": "my.mod:score", "service": {"url": "http://x:1"}})
    client = reward_service_client(own, "http://127.0.0.1:9000")  # the plan's endpoint wins
    assert (client.url, client.reward) == ("http://127.0.0.1:9000", "my.mod:score")
    with pytest.raises(ConfigError, match="no url is known"):
        reward_service_client(_job(reward={"function": "exact_match", "service": {}}), None)


def test_wandb_entity_and_project_reach_the_run(tmp_path, monkeypatch):
    """An offline W&B run (the real library, no server) records the spec's entity and project."""
    from harness.services.wandb_files import wandb_records
    from lorarl.trainer.telemetry.sinks import WandbSink
    from lorarl.trainer.telemetry.tracking import RunIds

    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # no key: offline
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    job = _job(logging={"backends": ["wandb"], "wandb": {"project": "p1", "entity": "team-x"}})
    sink = WandbSink(job.spec.logging.wandb, job, tmp_path, RunIds(tmp_path))
    sink.open()
    sink.log_metrics(1, {"reward_mean": 0.5})
    sink.close(failed=False)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 20  # wandb's own service process writes the file
    while True:
        try:
            records = list(wandb_records(run_file))
        except Exception:  # a record half written: read again
            records = []
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert runs and {(r.entity, r.project) for r in runs} == {("team-x", "p1")}


def test_claims_mount_where_they_are_read_and_only_outputs_are_writable():
    job = _job(
        model={"path": "/models/m", "volume": {"claimName": "models", "mountPath": "/models"}},
        data={"trainFiles": ["/data/t.jsonl"],
              "volume": {"claimName": "data", "mountPath": "/data", "readOnly": False}},
        training={"outputDir": "/out/run",
                  "volume": {"claimName": "outs", "mountPath": "/out"}},
    )  # fmt: skip
    p = plan(job)

    def claims(role: str) -> dict[str, tuple[str, bool]]:
        r = p.role(role)
        vols = {v.name: v for v in r.volumes if v.kind == "pvc"}
        mounts = {m.volume: m for m in r.replicas[0].containers[0].mounts}
        return {vols[n].source: (mounts[n].path, mounts[n].read_only) for n in vols}

    assert claims("trainer") == {
        "models": ("/models", True),
        "data": ("/data", True),  # readOnly false asks for nothing lorarl would write
        "outs": ("/out", False),
    }
    assert claims("rollout") == {"models": ("/models", True)}
