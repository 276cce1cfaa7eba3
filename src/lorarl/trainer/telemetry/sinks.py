"""The tracker backends behind `tracking.Fanout`: TensorBoard event files, an MLflow run, a W&B
run. Each imports its library when built (a missing one is a ConfigError at start) and does
its network work in `open` and after, on the fan-out's thread."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.tracking import MlflowSettings, WandbSettings
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.telemetry.tracking import MetricSink, RunIds

if TYPE_CHECKING:  # imported for real only by the sink of the backend a job selects
    from mlflow import MlflowClient
    from torch.utils.tensorboard import SummaryWriter
    from wandb.sdk.wandb_run import Run as WandbRun

_Handle = TypeVar("_Handle")

TENSORBOARD_DIR = "tensorboard"
# MLflow's client retries a failed request for minutes by default; the fan-out has its own
# backoff, so one short try per record (a user's own setting wins).
MLFLOW_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "advantage", "finish_reason")


def _need(module: str, backend: str, package: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise ConfigError(
            f"spec.logging.backends: {backend} needs the {package} package in the trainer image "
            f"(pip install 'lorarl[tracking]'): {exc}"
        ) from exc


def _opened(handle: _Handle | None, sink: str) -> _Handle:
    if handle is None:
        raise RuntimeError(f"the {sink} sink is used before open()")
    return handle


def run_name(job: LoRARLJob) -> str:
    """The tracker run's display name: spec.logging.runName, else the job's name."""
    return job.spec.logging.run_name or job.name


def sample_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    return list(SAMPLE_COLUMNS), [[r.get(c) for c in SAMPLE_COLUMNS] for r in rows]


class TensorBoardSink:
    """Scalars and a markdown table of samples under outputDir/tensorboard."""

    name = "tensorboard"

    def __init__(self, output_dir: Path):
        self._module = _need("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.log_dir = output_dir / TENSORBOARD_DIR
        self.writer: SummaryWriter | None = None

    def open(self) -> None:
        self.writer = self._module.SummaryWriter(log_dir=str(self.log_dir))

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        writer = _opened(self.writer, self.name)
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)
        writer.flush()  # readable while the run goes on

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        writer = _opened(self.writer, self.name)
        writer.add_text("samples", _markdown(rows), step)
        writer.flush()

    def close(self, failed: bool) -> None:
        _opened(self.writer, self.name).close()


def _markdown(rows: list[dict[str, Any]]) -> str:
    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    columns, data = sample_table(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


class MlflowSink:
    """One MLflow run per job (kept across trainer restarts), metrics by step, and each
    sample set as a table artifact samples/step_<N>.json (MLflow's table JSON)."""

    name = "mlflow"

    def __init__(self, settings: MlflowSettings, job: LoRARLJob, ids: RunIds):
        self._mlflow = _need("mlflow", "mlflow", "mlflow-skinny")
        for key, value in MLFLOW_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.uri = settings.tracking_uri
        self.experiment = settings.experiment or job.name
        self.job, self.ids = job, ids
        self.client: MlflowClient | None = None
        self.run_id: str | None = None

    def open(self) -> None:
        client = self._mlflow.MlflowClient(tracking_uri=self.uri)
        known = self.ids.get("mlflow_run_id")
        if known is not None and self._run_exists(client, known):
            client.update_run(known, status="RUNNING")
            self.client, self.run_id = client, known
            return
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment)
        run = client.create_run(
            exp_id, run_name=run_name(self.job), tags={"lorarl.job": self.job.name}
        )
        self.client, self.run_id = client, run.info.run_id
        self.ids.set("mlflow_run_id", self.run_id)
        client.log_dict(self.run_id, self.job.spec.wire(), "job_spec.json")

    def _run_exists(self, client, run_id: str) -> bool:
        """False only when the server says the run is gone or deleted (start a new one); any
        other error (the server is down) propagates, for the fan-out to retry later."""
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise
        return run.info.lifecycle_stage != "deleted"

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        client, run_id = _opened(self.client, self.name), _opened(self.run_id, self.name)
        for i in range(0, len(batch), 1000):  # MLflow's per-request limit
            client.log_batch(run_id, metrics=batch[i : i + 1000], synchronous=True)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        # The JSON `log_table` writes ({"columns", "data"}), without its pandas dependency.
        columns, data = sample_table(rows)
        table = {"columns": columns, "data": data}
        client, run_id = _opened(self.client, self.name), _opened(self.run_id, self.name)
        client.log_dict(run_id, table, f"samples/step_{step:08d}.json")

    def close(self, failed: bool) -> None:
        client, run_id = _opened(self.client, self.name), _opened(self.run_id, self.name)
        client.set_terminated(run_id, status="FAILED" if failed else "FINISHED")


class WandbSink:
    """A W&B run under outputDir/wandb: online with an API key, else offline (sync it later
    with `wandb sync`). The run id is kept so a restarted trainer resumes the same run."""

    name = "wandb"

    def __init__(self, settings: WandbSettings, job: LoRARLJob, output_dir: Path, ids: RunIds):
        self._wandb = _need("wandb", "wandb", "wandb")
        has_key = bool(os.environ.get("WANDB_API_KEY"))
        if settings.mode == "online" and not has_key:
            raise ConfigError(
                "spec.logging.wandb.mode: online needs WANDB_API_KEY (logging.wandb.apiKeySecret)"
            )
        self.mode = settings.mode or ("online" if has_key else "offline")
        self.settings, self.job, self.output_dir, self.ids = settings, job, output_dir, ids
        self.run: WandbRun | None = None

    def open(self) -> None:
        wandb, s = self._wandb, self.settings
        run_id = self.ids.get("wandb_run_id")
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]
            self.ids.set("wandb_run_id", run_id)
        options: dict[str, Any] = {
            "console": "off",  # the trainer's stdout is its step log; leave it alone
            "x_disable_stats": True,
            "silent": True,
            "init_timeout": 60,
        }
        if s.base_url:
            options["base_url"] = s.base_url
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=s.project or self.job.name,
            entity=s.entity,
            name=run_name(self.job),
            id=run_id,
            resume="allow",
            mode=self.mode,
            dir=str(self.output_dir),
            config=self.job.spec.wire(),
            settings=wandb.Settings(**options),
        )

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        _opened(self.run, self.name).log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = sample_table(rows)
        _opened(self.run, self.name).log(
            {"samples": self._wandb.Table(columns=columns, data=data)}, step=step
        )

    def close(self, failed: bool) -> None:
        _opened(self.run, self.name).finish(exit_code=1 if failed else 0)


def make_sink(backend: str, job: LoRARLJob, output_dir: Path, ids: RunIds) -> MetricSink:
    logging_spec = job.spec.logging
    if backend == "tensorboard":
        return TensorBoardSink(output_dir)
    if backend == "mlflow":
        if logging_spec.mlflow is None:
            raise ConfigError("spec.logging.mlflow.trackingUri is required by the mlflow backend")
        return MlflowSink(logging_spec.mlflow, job, ids)
    if backend == "wandb":
        return WandbSink(logging_spec.wandb or WandbSettings(), job, output_dir, ids)
    raise ConfigError(f"spec.logging.backends: unknown backend {backend!r}")
