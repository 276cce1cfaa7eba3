"""The timer's steady path (1,000 running jobs, bench/operator_steady.py) skips work only where
nothing it reads has changed: the job body is copied again only when its resourceVersion moved
(the status write's reply is kept as the body), the spec is parsed again only when its
generation or labels moved, and a progress answer equal byte for byte to the last one is not
parsed again. Every new step still reaches the status on the tick that sees it."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml

from lorarl.api.reports.progress import Progress
from lorarl.bounded_fetch import FetchError
from lorarl.operator import progress_fetch, reconciler
from lorarl.operator.config import OperatorConfig
from lorarl.operator.reconciler import Reconciler
from lorarl.operator.status import PodView

ROOT = Path(__file__).resolve().parents[3]
JOB = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
JOB["metadata"].update(namespace="default", uid="uid-1", generation=1, resourceVersion="10")
NAME = JOB["metadata"]["name"]
PODS = [
    PodView(
        name=f"{NAME}-{role}-{i}",
        job=NAME,
        role=role,
        index=i,
        attempt=0,
        phase="Running",
        uid=f"{role}-{i}",
    )
    for role, i in (("trainer", 0), ("rollout", 0), ("rollout", 1))
]


class FakeKube:
    """Status patches answered as the API server does: the whole object, a new version."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.version = 100
        self.uid = "uid-1"

    async def create(self, obj: dict[str, Any]) -> None:
        return None

    async def delete(self, url: str, *, what: str) -> bool:
        return True

    async def merge_patch(self, url: str, body: dict[str, Any], *, what: str) -> dict[str, Any]:
        if not url.endswith("/status"):
            return {}  # the job's ConfigMap (its create found one): not the job
        self.patches.append(body)
        self.version += 1
        obj = copy.deepcopy(JOB)
        obj["metadata"].update(uid=self.uid, resourceVersion=str(self.version))
        obj["status"] = body["status"]
        return obj


class Trainer:
    """`GET /progress` of the job's trainer rank 0: the same bytes until its step moves."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step = 1
        self.polls = 0
        self.down = False
        self.step_seconds: float | None = None
        monkeypatch.setattr(progress_fetch, "fetch_bytes", self.fetch)
        monkeypatch.setattr(progress_fetch, "session", lambda *a: object())  # no sockets here

    async def fetch(self, session: Any, url: str, **_: Any) -> bytes:
        self.polls += 1
        if self.down:
            raise FetchError(f"{url}: connection refused")
        report = {
            "job": NAME,
            "phase": "Running",
            "step": self.step,
            "totalSteps": 1000,
            "latest": {"step": self.step, "time": 1.0e9 + self.step, "rewardMean": 0.5,
                       "stepSeconds": self.step_seconds},
        }  # fmt: skip
        return json.dumps(report).encode()


@pytest.fixture(autouse=True)
def no_kopf_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf.event and kopf.adopt need a running kopf; here they only record nothing."""
    monkeypatch.setattr(kopf, "event", lambda *a, **k: None)
    monkeypatch.setattr(kopf, "adopt", lambda *a, **k: None)


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def _tick(rec: Reconciler, body: dict[str, Any]) -> Any:
    return asyncio.run(rec.reconcile(body, PODS, trigger="timer", poll=True))


def _running(kube: FakeKube) -> tuple[Reconciler, dict[str, Any]]:
    """A reconciler that has written the job's Running status once, and the body the watch
    then delivers (the patch reply's version)."""
    rec = Reconciler(kube, OperatorConfig(progress_url="http://trainer"))  # type: ignore[arg-type]
    decision = _tick(rec, JOB)
    assert decision is not None and decision.status.phase == "Running"
    assert not decision.create and not decision.delete
    watched = copy.deepcopy(rec.jobs[("default", NAME)].body)
    return rec, watched


def test_every_new_step_reaches_the_status_on_the_tick_that_sees_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trainer, kube = Trainer(monkeypatch), FakeKube()
    rec, body = _running(kube)
    assert kube.patches[-1]["status"]["step"] == 1
    written = []
    for step in (1, 1, 2, 2, 2, 3, 5, 5):
        trainer.step = step
        before = len(kube.patches)
        decision = _tick(rec, body)
        assert decision is not None and decision.status.step == step
        if len(kube.patches) > before:
            written.append(kube.patches[-1]["status"]["step"])
            body = copy.deepcopy(rec.jobs[("default", NAME)].body)  # the watch catches up
    assert written == [2, 3, 5]  # each new step once, on its own tick; none for the same step
    assert trainer.polls == 9  # every tick polled


def test_an_unreachable_trainer_keeps_the_last_report(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, kube = Trainer(monkeypatch), FakeKube()
    rec, body = _running(kube)
    trainer.down, before = True, len(kube.patches)
    decision = _tick(rec, body)
    assert decision is not None and decision.status.step == 1 and len(kube.patches) == before
    trainer.down, trainer.step = False, 4
    decision = _tick(rec, body)
    assert decision is not None and kube.patches[-1]["status"]["step"] == 4


def test_the_same_answer_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, kube = Trainer(monkeypatch), FakeKube()
    rec, body = _running(kube)
    state = rec.jobs[("default", NAME)]
    first = state.progress
    validations = _counting(monkeypatch, Progress, "model_validate")
    _tick(rec, body)
    assert state.progress is first and validations == []
    trainer.step = 2
    _tick(rec, body)
    assert state.progress is not first and state.progress is not None
    assert state.progress.step == 2 and len(validations) == 1


def test_the_body_is_copied_only_when_its_version_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Reconciler(FakeKube(), OperatorConfig())  # type: ignore[arg-type]
    kept = rec.remember(JOB).body
    same_version = copy.deepcopy(JOB)
    same_version["spec"]["rollout"]["replicas"] = 7  # cannot happen: one version, one content
    assert rec.remember(same_version).body is kept
    moved = copy.deepcopy(JOB)
    moved["metadata"]["resourceVersion"] = "11"
    moved["spec"]["rollout"]["replicas"] = 3
    assert rec.remember(moved).body["spec"]["rollout"]["replicas"] == 3
    unversioned = copy.deepcopy(JOB)
    del unversioned["metadata"]["resourceVersion"]
    first = rec.remember(unversioned).body
    assert rec.remember(unversioned).body is not first  # no version: always a fresh copy
    recreated = copy.deepcopy(JOB)
    recreated["metadata"]["uid"] = "uid-2"
    assert rec.remember(recreated).uid == "uid-2"


def test_the_status_write_reply_becomes_the_body(monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, kube = Trainer(monkeypatch), FakeKube()
    rec, watched = _running(kube)
    state = rec.jobs[("default", NAME)]
    assert state.body["metadata"]["resourceVersion"] == str(kube.version)
    assert state.body["status"]["phase"] == "Running"
    copies = _counting(monkeypatch, reconciler, "plain")
    _tick(rec, watched)  # the watch's body of that version: nothing copied
    assert copies == []
    kube.uid, trainer.step = "another", 2  # a reply for another object of that name...
    before = len(kube.patches)
    _tick(rec, watched)
    assert len(kube.patches) == before + 1
    assert state.body["metadata"]["uid"] == "uid-1"  # ...is not kept


def test_the_spec_is_parsed_again_when_generation_or_labels_move(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    Trainer(monkeypatch)
    kube = FakeKube()
    rec, body = _running(kube)
    parses = _counting(monkeypatch, reconciler, "parsed")
    status_only = copy.deepcopy(body)
    status_only["metadata"]["resourceVersion"] = "500"
    status_only["status"]["message"] = "another writer"
    _tick(rec, status_only)
    assert parses == []  # a new version with the same spec generation: the parse is reused

    scaled = copy.deepcopy(body)
    scaled["metadata"].update(resourceVersion="501", generation=2)
    scaled["spec"]["rollout"]["replicas"] = 3
    decision = _tick(rec, scaled)
    assert len(parses) == 1
    assert decision is not None and ("rollout", 2) in decision.create  # the new spec is used

    relabelled = copy.deepcopy(scaled)
    relabelled["metadata"].update(resourceVersion="502", labels={"team": "b"})
    _tick(rec, relabelled)
    assert len(parses) == 2
    state = rec.jobs[("default", NAME)]
    assert state.parsed is not None and state.parsed.job.metadata.labels == {"team": "b"}

    no_generation = copy.deepcopy(relabelled)
    del no_generation["metadata"]["generation"]
    no_generation["metadata"]["resourceVersion"] = "503"
    _tick(rec, no_generation)
    _tick(rec, no_generation)
    assert len(parses) == 4  # nothing to tell versions of the spec apart: parsed every pass


def test_polls_wait_for_the_next_step_but_never_more_than_two_ticks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps 30 s apart, a tick every 10 s: a tick polls only from half a tick before the next
    step is due (so 1 poll in 3), and a step that comes sooner than the last one took is still
    seen within MAX_SKIPPED_POLLS + 1 ticks."""
    now = [0.0]
    monkeypatch.setattr(reconciler.time, "monotonic", lambda: now[0])
    trainer, kube = Trainer(monkeypatch), FakeKube()
    trainer.step_seconds = 30.0
    rec, body = _running(kube)  # polled at t=0: step 1 arrived then
    seen = []
    for t, step in ((10, 1), (20, 1), (30, 2), (40, 2), (50, 2), (60, 2), (70, 3)):
        now[0], trainer.step, before = float(t), step, trainer.polls
        decision = _tick(rec, body)
        assert decision is not None
        seen.append((trainer.polls - before, decision.status.step))
        body = copy.deepcopy(rec.jobs[("default", NAME)].body)
    # t=10, 20 skip (due at 25); t=30 sees step 2; 40, 50 skip; 60 polls (due 55), 70 again
    assert seen == [(0, 1), (0, 1), (1, 2), (0, 2), (0, 2), (1, 2), (1, 3)]
    trainer.step_seconds = 1000.0  # a slow step, then a fast one: 2 ticks skipped at most
    trainer.step = 4
    now[0] = 100.0  # due at 95
    assert _tick(rec, body).status.step == 4
    body = copy.deepcopy(rec.jobs[("default", NAME)].body)
    trainer.step = 5
    got = []
    for t in (110, 120, 130):
        now[0] = float(t)
        got.append(_tick(rec, body).status.step)
        body = copy.deepcopy(rec.jobs[("default", NAME)].body)
    assert got == [4, 4, 5]
    assert reconciler.MAX_SKIPPED_POLLS == 2
