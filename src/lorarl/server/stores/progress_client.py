"""Reads a trainer's progress endpoint (`GET /progress`, `GET /progress/history`).

Every read is capped in bytes and in total time (`lorarl.bounded_fetch`): whatever answers at a
trainer's address must not make the status API parse a giant body or hold one of its threads.
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.samples import SampleRecord
from lorarl.bounded_fetch import (
    DEADLINE_S,
    MAX_HISTORY_BYTES,
    MAX_PROGRESS_BYTES,
    FetchError,
    get_json_sync,
)

_HISTORY = TypeAdapter(list[StepRecord])
_SAMPLES = TypeAdapter(list[SampleRecord])


class TrainerUnreachable(RuntimeError):
    """The trainer did not answer (finished, restarting, or not started yet) or answered junk."""


def base_url(url: str) -> str:
    """Accepts `http://host:port`, `.../progress` or `.../progress/history` for the same trainer."""
    url = url.rstrip("/")
    for suffix in ("/progress/history", "/progress"):
        if url.endswith(suffix):
            return url[: -len(suffix)]
    return url


class ProgressClient:
    """Short timeouts: a dashboard refresh must not hang on a trainer that went away.

    `timeout`: seconds per network read; `deadline`: seconds for a whole request, however the
    peer paces its bytes."""

    def __init__(
        self,
        timeout: float = 2.0,
        *,
        deadline: float = DEADLINE_S,
        max_progress_bytes: int = MAX_PROGRESS_BYTES,
        max_history_bytes: int = MAX_HISTORY_BYTES,
    ) -> None:
        self._timeout, self._deadline = timeout, deadline
        self._max_progress, self._max_history = max_progress_bytes, max_history_bytes

    def _get(self, url: str, max_bytes: int) -> object:
        try:
            return get_json_sync(
                url, max_bytes=max_bytes, deadline_s=self._deadline, read_timeout=self._timeout
            )
        except FetchError as exc:
            raise TrainerUnreachable(str(exc)) from exc

    def progress(self, base: str) -> Progress:
        url = f"{base_url(base)}/progress"
        try:
            return Progress.model_validate(self._get(url, self._max_progress))
        except ValidationError as exc:
            raise TrainerUnreachable(f"{url}: unreadable progress: {exc}") from exc

    def history(self, base: str) -> list[StepRecord]:
        url = f"{base_url(base)}/progress/history"
        try:
            return _HISTORY.validate_python(self._get(url, self._max_history))
        except ValidationError as exc:
            raise TrainerUnreachable(f"{url}: unreadable history: {exc}") from exc

    def samples(self, base: str) -> list[SampleRecord]:
        url = f"{base_url(base)}/progress/samples"
        try:
            return _SAMPLES.validate_python(self._get(url, self._max_history))
        except ValidationError as exc:
            raise TrainerUnreachable(f"{url}: unreadable samples: {exc}") from exc

    def close(self) -> None:
        """Nothing to release: each read uses its own short-lived connection."""
