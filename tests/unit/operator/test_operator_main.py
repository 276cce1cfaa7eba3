"""`python -m lorarl.operator` tunes the garbage collector before kopf starts: with the defaults,
collections were ~18% of the operator's CPU creating 200 jobs (bench/operator_scale.py)."""

from __future__ import annotations

import gc

import kopf
import pytest

from lorarl.operator import __main__ as entry
from lorarl.operator.config import GC_THRESHOLDS


def test_main_freezes_imports_and_raises_gc_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}
    monkeypatch.setattr(kopf, "configure", lambda **_: None)
    monkeypatch.setattr(
        kopf,
        "run",
        lambda **kw: seen.update(threshold=gc.get_threshold(), frozen=gc.get_freeze_count(), **kw),
    )
    before = gc.get_threshold()
    try:
        entry.main()
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
    assert seen["threshold"] == GC_THRESHOLDS
    assert GC_THRESHOLDS[0] > before[0]
    assert seen["frozen"] > 10_000  # kopf, pydantic, the handlers: all loaded and frozen
    assert seen["standalone"] is True
