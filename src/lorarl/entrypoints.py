"""`module:attr` entrypoints from the job's image: reward functions and environment classes."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_entrypoint(spec: str, kind: str, *, want: str = "callable") -> Callable[..., Any]:
    """The callable `attr` (dotted for nested ones) of `module`; ValueError naming `kind` and
    `spec` when the module does not import, lacks it, or it is not callable."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r}: {attr!r} is a {type(obj).__name__}, not {want}")
    return obj
