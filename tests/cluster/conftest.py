"""Tests on the real control plane; its fixtures (`cp`, `cp_with_crd`, `crd_server`,
`namespace`) live in tests/conftest.py so agreement tests elsewhere can use them too."""

from __future__ import annotations

from tests.conftest import CRD_PATH, ROOT

__all__ = ["CRD_PATH", "ROOT"]
