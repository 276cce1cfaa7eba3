"""What keeps a reconcile pass cheap at scale: the spec's parse is reused while only kopf's
bookkeeping changes, and a burst of pod events for one job becomes one pass."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from lorarl.api import safe_yaml
from lorarl.api.validation import ManifestError
from lorarl.operator.config import OperatorConfig
from lorarl.operator.parsing import parsed
from lorarl.operator.reconciler import Reconciler
from lorarl.operator.status import PodView

ROOT = Path(__file__).resolve().parents[3]
JOB = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
JOB["metadata"].update(namespace="default", uid="uid-1", generation=1)


def test_parse_is_reused_until_the_spec_changes() -> None:
    first = parsed(JOB, None)
    bookkeeping = copy.deepcopy(JOB)
    bookkeeping["metadata"]["annotations"] = {"lorarl.dev/last-handled-configuration": "{}"}
    bookkeeping["metadata"]["resourceVersion"] = "42"
    bookkeeping["status"] = {"phase": "Running"}
    assert parsed(bookkeeping, first) is first

    scaled = copy.deepcopy(JOB)
    scaled["spec"]["rollout"]["replicas"] = JOB["spec"]["rollout"].get("replicas", 2) + 1
    again = parsed(scaled, first)
    assert again is not first
    assert again.config_hash != first.config_hash
    assert again.config == parsed(scaled, None).config

    relabelled = copy.deepcopy(JOB)
    relabelled["metadata"]["labels"] = {"team": "b"}
    assert parsed(relabelled, first) is not first  # labels reach the rendered config


def test_a_bad_spec_is_not_served_from_the_cache() -> None:
    first = parsed(JOB, None)
    bad = copy.deepcopy(JOB)
    bad["spec"]["rollout"]["replicas"] = -1
    with pytest.raises(ManifestError, match="replicas"):
        parsed(bad, first)


def test_a_new_spec_is_rendered_to_yaml_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size rule and the ConfigMap read one rendering; a changed spec is rendered afresh."""
    dumps: list[object] = []
    real = safe_yaml.dump
    monkeypatch.setattr(safe_yaml, "dump", lambda data: dumps.append(data) or real(data))
    job = copy.deepcopy(JOB)
    job["spec"]["optim"]["lr"] = 0.0123  # a config no earlier test rendered
    first = parsed(job, None)
    assert len(dumps) == 1
    assert first.config["job.yaml"] == real(first.plan.config)
    assert "lr: 0.0123" in first.config["job.yaml"]
    job["spec"]["optim"]["lr"] = 0.0124
    second = parsed(job, first)
    assert len(dumps) == 2 and "lr: 0.0124" in second.config["job.yaml"]


class Recording(Reconciler):
    """The real debounce and lock; the pass itself only records what it was given."""

    def __init__(self) -> None:
        super().__init__(kube=None, config=OperatorConfig())  # type: ignore[arg-type]
        self.debounce = 0.05
        self.passes: list[tuple[str, list[str]]] = []

    async def _pass(self, state: Any, pods: list[PodView], trigger: str, poll: bool) -> None:
        self.passes.append((trigger, [p.name for p in pods]))
        await asyncio.sleep(0.05)  # a pass takes a while: events meanwhile start the next one


def _pod(name: str) -> PodView:
    return PodView(name=name, job="demo", role="rollout", index=0, attempt=0, phase="Running",
                   uid=name)  # fmt: skip


def test_a_burst_of_pod_events_becomes_one_pass_with_the_newest_pods() -> None:
    async def scenario() -> list[tuple[str, list[str]]]:
        rec = Recording()
        rec.remember(JOB)
        ns, name = "default", JOB["metadata"]["name"]
        burst = [rec.poke(ns, name, [_pod(f"p{i}")], "pod") for i in range(5)]
        await asyncio.gather(*burst)
        # One event while a pass runs: a second pass follows it (nothing is lost).
        first = asyncio.create_task(rec.poke(ns, name, [_pod("a")], "pod"))
        await asyncio.sleep(0.07)  # the pass for "a" has begun
        await rec.poke(ns, name, [_pod("b")], "pod")
        await first
        await rec.poke("default", "unknown-job", [_pod("x")], "pod")  # never seen: ignored
        await rec.close()
        return rec.passes

    assert asyncio.run(scenario()) == [("pod", ["p4"]), ("pod", ["a"]), ("pod", ["b"])]
