"""Small complete jobs for end-to-end tests: a tiny model, a verifiable task, test engines.

The task: "after c" -> "d". A random tiny model almost never says the right letter (~3% within
four tokens), so a rising reward means the whole loop works: generation, scoring, advantages, the
FSDP update, and the weight sync that puts the new policy into the engines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from harness.workloads.tiny_models import make_tiny_model
from lorarl.api import LoRARLJob
from lorarl.plan import ContainerPlan, ReplicaPlan

LETTERS = "abcdefgh"


def write_letter_task(path: Path) -> Path:
    rows = []
    for c in LETTERS:
        nxt = chr(ord(c) + 1)
        rows.append({"prompt": f"after {c}", "answer": nxt, "pattern": f"^.{{0,3}}{nxt}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def letter_job(root: Path, *, name: str = "learn", **overrides: Any) -> LoRARLJob:
    """A job on the letter task; `overrides` replace whole spec sections (None: leave it out)."""
    model = root / "model"
    if not (model / "config.json").is_file():
        make_tiny_model(model, "llama", seed=0, init_std=0.1)
    data = write_letter_task(root / "letters.jsonl")
    spec: dict[str, Any] = {
        "model": {"path": str(model), "dtype": "float32"},
        "lora": {"rank": 8, "alpha": 16},
        "algorithm": {"name": "grpo", "groupSize": 8},
        "optim": {"lr": 3e-3},
        "data": {"trainFiles": [str(data)], "maxPromptTokens": 32, "maxResponseTokens": 4},
        "reward": {"function": "regex_match", "params": {"metadata_key": "pattern"}},
        "training": {
            "totalSteps": 30,
            "promptsPerStep": 8,
            "microBatchSize": 16,
            "checkpointInterval": 10,
        },
        "trainer": {"gpusPerReplica": 0, "processesPerReplica": 2},
        "rollout": {"engine": "vllm", "replicas": 2, "gpusPerReplica": 0, "syncMode": "merged"},
    }
    spec.update(overrides)
    spec = {k: v for k, v in spec.items() if v is not None}
    return LoRARLJob.model_validate(
        {
            "apiVersion": "lorarl.dev/v1alpha1",
            "kind": "LoRARLJob",
            "metadata": {"name": name},
            "spec": spec,
        }
    )


def hf_engine(replica: ReplicaPlan, container: ContainerPlan, model: str) -> list[str]:
    """The test engine in place of vLLM: same HTTP API, including the weight-update routes."""
    return [
        sys.executable, "-m", "harness.engines.hf_engine_server", "--model", model,
        "--port", str(container.ports["engine"]), "--served-model-name", "base",
    ]  # fmt: skip


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "history.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
