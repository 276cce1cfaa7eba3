"""A job's spec -> its validated model, plan and rendered config, reused while the spec is
unchanged (the reconciler's hot path runs this on every event and timer tick)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from lorarl.api.job import LoRARLJob
from lorarl.api.rules import CLUSTER
from lorarl.api.safe_yaml import InputLimitError, check_tree
from lorarl.api.validation import parse_job
from lorarl.operator import builders
from lorarl.plan import JobPlan, plan


def plain(value: Any) -> Any:
    """kopf's live mapping views -> plain dicts and lists (safe to keep and to serialize)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


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
    """What the job's model is built from: only name, namespace and labels of the metadata (so
    kopf's bookkeeping annotations never change the rendered config)."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "labels": dict(meta.get("labels") or {}),
        },
        "spec": plain(body.get("spec") or {}),
    }


def parsed(body: Mapping[str, Any], cached: Parsed | None) -> Parsed:
    """The cached parse when the job's input is the same, else a fresh one (raises
    ManifestError/ValueError for a spec the webhook would refuse)."""
    doc = job_input(body)
    key = json.dumps(doc, sort_keys=True, default=str)
    if cached is not None and cached.key == key:
        return cached
    try:  # one validation when the spec is good (parse_job validates twice, to list problems)
        check_tree(doc)
        job = LoRARLJob.model_validate(doc, context=CLUSTER)
    except (InputLimitError, RecursionError, ValidationError):
        job = parse_job(doc, cluster=True)  # raises ManifestError with every problem listed
    job_plan = plan(job)
    config = builders.config_data(job_plan)
    return Parsed(key, job, job_plan, config, _hash(config))
