"""A job's spec -> its validated model, plan and rendered config, reused while the spec is
unchanged (the reconciler's hot path runs this on every event and timer tick)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lorarl.api.resource import LoRARLJob
from lorarl.api.safe_yaml import InputLimitError, check_tree
from lorarl.api.validation import ManifestError, Problem, parse_job
from lorarl.operator import builders
from lorarl.plan import JobPlan, plan


def _empty_like(value: Any) -> dict[Any, Any] | list[Any] | None:
    if isinstance(value, Mapping):
        return {}
    if isinstance(value, list | tuple):
        return []
    return None


def plain(value: Any) -> Any:
    """kopf's live mapping views -> plain dicts and lists (safe to keep and to serialize).

    Iterative: with the webhook off, the API server stores a schemaless field (`reward.params`)
    nested thousands deep, and a recursive copy would raise RecursionError on every event."""
    root = _empty_like(value)
    if root is None:
        return value
    stack: list[tuple[Any, dict[Any, Any] | list[Any]]] = [(value, root)]
    while stack:
        source, target = stack.pop()
        items = source.items() if isinstance(source, Mapping) else enumerate(source)
        for key, item in items:
            copy = _empty_like(item)
            if copy is not None:
                stack.append((item, copy))
            if isinstance(target, dict):
                target[key] = item if copy is None else copy
            else:
                target.append(item if copy is None else copy)
    return root


def job_from_body(body: Mapping[str, Any]) -> LoRARLJob:
    """The job as every process sees it (see `job_input`)."""
    return parse_job(job_input(body), cluster=True)


def _hash(data: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Parsed:
    """A job's validated model, plan and rendered config, and the input they came from.

    Validating a spec renders it to YAML (the ConfigMap size rule) and planning renders it
    again: tens of milliseconds that every pod event and timer tick would otherwise repeat for
    a spec that has not changed."""

    key: str
    job: LoRARLJob
    plan: JobPlan
    config: dict[str, str]
    config_hash: str


def job_input(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the job's model is built from: only name, namespace, uid and labels of the metadata
    (so kopf's bookkeeping annotations never change the rendered config; the uid names a hub id
    model's pin in a shared cache, plan/hub.py)."""
    meta = body.get("metadata") or {}
    metadata = {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "labels": dict(meta.get("labels") or {}),
    }
    if meta.get("uid"):
        metadata["uid"] = str(meta["uid"])
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": metadata,
        "spec": plain(body.get("spec") or {}),
    }


def parsed(body: Mapping[str, Any], cached: Parsed | None) -> Parsed:
    """The cached parse when the job's input is the same, else a fresh one (raises
    ManifestError/ValueError for a spec the webhook would refuse)."""
    doc = job_input(body)
    try:  # before anything recursive (json.dumps, pydantic) touches it
        check_tree(doc)
    except InputLimitError as exc:
        raise ManifestError([Problem("spec", f"manifest refused: {exc}")]) from None
    key = json.dumps(doc, sort_keys=True, default=str)
    if cached is not None and cached.key == key:
        return cached
    job = parse_job(doc, cluster=True)  # the webhook's reading; ManifestError lists every problem
    job_plan = plan(job)
    config = builders.config_data(job_plan)
    return Parsed(key, job, job_plan, config, _hash(config))
