"""A hub id in a local run: fetched into the user's hub cache before any process starts.

Every process of the run then reads the snapshot folder, exactly as pods read the cache their
init container filled (plan/hub.py); `model.json` in the run folder records the commit.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from lorarl.api.resource import LoRARLJob
from lorarl.hub import Snapshot, fetch
from lorarl.local.runs import MODEL_RECORD

log = logging.getLogger(__name__)


def fetch_job_model(
    job: LoRARLJob, revision: str | None = None
) -> tuple[LoRARLJob, Snapshot | None]:
    """The job with a hub id replaced by its snapshot folder (unchanged for a folder);
    `revision` (a continued run's commit) overrides the spec's. The token is the user's
    (HF_TOKEN or `hf auth login`); spec.model.hub.tokenSecret is a cluster's Secret. Raises
    HubError (one line) when the model can be neither downloaded nor found in the cache."""
    model = job.spec.model
    if not model.from_hub:
        return job, None
    endpoint = model.hub.endpoint if model.hub is not None else None
    snapshot = fetch(model.path, revision=revision or model.revision, endpoint=endpoint)
    log.info("%s at commit %s: %s", model.path, snapshot.revision, snapshot.path)
    local = job.model_copy(deep=True)
    local.spec.model = model.model_copy(
        update={"path": str(snapshot.path), "revision": None, "hub": None}
    )
    return local, snapshot


def record_model(run_dir: Path, snapshot: Snapshot) -> None:
    """What `status.model` says in a cluster: the hub id and the commit the run loads."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MODEL_RECORD
    tmp = path.with_suffix(".tmp")
    record = {"source": snapshot.repo, "revision": snapshot.revision, "path": str(snapshot.path)}
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
