"""The real pretrained model for slow tests, converted once into the repo's cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorarl.local.models import ModelUnavailable, prepare_smollm2

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "lorarl" / "models"


def smollm2() -> Path:
    try:
        return prepare_smollm2(CACHE)
    except ModelUnavailable as exc:
        pytest.skip(str(exc))
