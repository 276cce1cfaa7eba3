"""A sync sidecar that acknowledges updates without pushing them to its engine (a test fault).

On PYTHONPATH with `LORARL_TEST_LAZY_SIDECAR=<replica index>`, the sidecar of that replica gets
an `UpdateApplier` whose merged push and adapter load do nothing: it validates every update,
reports it applied (its `/healthz` says it serves the latest version) and acks it, while its
engine keeps the weights it had. Every other process (the trainer, engines, other sidecars) is
untouched: the patch is applied only when `lorarl.rollout.applier` is imported by that replica.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "lorarl.rollout.applier"


def _lazy(module) -> None:
    cls = module.UpdateApplier

    def _push_merged(self, header, pairs):  # acknowledged, never pushed
        return {"merge": 0.0, "push": 0.0}

    def _load_adapter(self, header, tensors):  # acknowledged, never loaded
        return {"write": 0.0, "load": 0.0}

    cls._push_merged, cls._load_adapter = _push_merged, _load_adapter


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _lazy(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("LORARL_TEST_LAZY_SIDECAR") not in (None, "") and os.environ.get(
    "LORARL_ROLLOUT_INDEX"
) == os.environ.get("LORARL_TEST_LAZY_SIDECAR"):
    sys.meta_path.insert(0, _Finder())
