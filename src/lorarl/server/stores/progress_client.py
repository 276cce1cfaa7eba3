"""Reads a trainer's progress endpoint (`GET /progress`, `GET /progress/history`)."""

from __future__ import annotations

import httpx
from pydantic import TypeAdapter, ValidationError

from lorarl.api.progress import Progress, StepRecord

_HISTORY = TypeAdapter(list[StepRecord])


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
    """Short timeouts: a dashboard refresh must not hang on a trainer that went away."""

    def __init__(self, timeout: float = 2.0, client: httpx.Client | None = None) -> None:
        self._client = client or httpx.Client(timeout=timeout, trust_env=False)

    def _get(self, url: str) -> object:
        try:
            response = self._client.get(url)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise TrainerUnreachable(f"{url}: {exc or type(exc).__name__}") from exc

    def progress(self, base: str) -> Progress:
        url = f"{base_url(base)}/progress"
        try:
            return Progress.model_validate(self._get(url))
        except ValidationError as exc:
            raise TrainerUnreachable(f"{url}: unreadable progress: {exc}") from exc

    def history(self, base: str) -> list[StepRecord]:
        url = f"{base_url(base)}/progress/history"
        try:
            return _HISTORY.validate_python(self._get(url))
        except ValidationError as exc:
            raise TrainerUnreachable(f"{url}: unreadable history: {exc}") from exc

    def close(self) -> None:
        self._client.close()
