"""Environment names in a job spec (`spec.environment.entrypoint`) -> classes and factories.

An entrypoint is a built-in name (`single_turn`, `tool_calling`) or `"package.module:Class"`.
`check_environment` is the admission check (the API model and the webhook call it: it imports no
user module and builds nothing); `environment_factory` is what the trainer calls at start: it
imports the class and builds one instance, so a bad job fails there and not at its first step.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from lorarl.entrypoints import import_entrypoint
from lorarl.environments.base import Environment
from lorarl.environments.single_turn import SingleTurn
from lorarl.environments.tool_calling import ToolCalling
from lorarl.rewards.sandbox.isolation import SandboxUnavailable

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "EnvironmentFactory",
    "UnknownEnvironmentError",
    "check_environment",
    "environment_factory",
    "list_environments",
]

BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "single_turn": SingleTurn,
    "tool_calling": ToolCalling,
}


class UnknownEnvironmentError(ValueError):
    """An entrypoint that is neither a built-in name nor `module:Class`."""


def list_environments() -> list[str]:
    return sorted(BUILTIN_ENVIRONMENTS)


def check_environment(entrypoint: str, params: Mapping[str, Any] | None) -> None:
    """What `environment_factory` would refuse, found without importing or building anything.

    A `module:Class` entrypoint lives in the job's image, so only its shape is checked here.
    Raises UnknownEnvironmentError for an unknown built-in, ValueError for refused params.
    """
    name = _entrypoint(entrypoint)
    params = _params(name, params)
    if ":" in name:
        return
    cls = _builtin(name)
    _check_accepts(name, cls, params)
    check = getattr(cls, "check_params", None)
    if check is not None:
        try:
            check(**params)
        except (TypeError, KeyError, AttributeError) as exc:  # a param of the wrong type
            raise ValueError(f"environment {name!r}: invalid params: {exc}") from None
        except ValueError as exc:
            raise ValueError(f"environment {name!r}: {exc}") from None


class EnvironmentFactory:
    """Builds one fresh environment per episode: `cls(**params)`, params copied each time."""

    def __init__(self, name: str, cls: Callable[..., Any], params: Mapping[str, Any]) -> None:
        self.name = name
        self.cls = cls
        self.params = dict(params)

    def __call__(self) -> Environment:
        return self.cls(**copy.deepcopy(self.params))

    def __repr__(self) -> str:
        return f"EnvironmentFactory({self.name!r}, params={self.params!r})"


def environment_factory(
    entrypoint: str, params: Mapping[str, Any] | None = None
) -> EnvironmentFactory:
    """Resolve the entrypoint and build one instance now, so bad params, a missing module or a
    class without reset/step fail when the job starts. Errors name the entrypoint."""
    name = _entrypoint(entrypoint)
    params = _params(name, params)
    cls = _import_class(name) if ":" in name else _builtin(name)
    if isinstance(cls, type):
        _check_methods(name, cls)
    if ":" not in name:
        check_environment(name, params)
    _check_accepts(name, cls, params)
    factory = EnvironmentFactory(name, cls, params)
    try:
        instance = factory()
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"environment {name!r}: invalid params: {exc}") from exc
    except SandboxUnavailable:
        raise  # says itself what the machine lacks and what to do
    except Exception as exc:
        raise RuntimeError(
            f"environment {name!r}: building it failed: {type(exc).__name__}: {exc}"
        ) from exc
    _check_methods(name, instance)
    return factory


def _entrypoint(entrypoint: Any) -> str:
    if not isinstance(entrypoint, str) or not entrypoint.strip():
        raise ValueError(f"environment entrypoint must be a non-empty string, got {entrypoint!r}")
    name = entrypoint.strip()
    if ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr or ":" in attr:
            raise ValueError(f"environment {name!r}: expected 'package.module:Class'")
    return name


def _params(name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, Mapping) or not all(isinstance(k, str) for k in params):
        raise ValueError(f"environment {name!r}: params must be a mapping of names to values")
    return dict(params)


def _builtin(name: str) -> type:
    cls = BUILTIN_ENVIRONMENTS.get(name)
    if cls is None:
        raise UnknownEnvironmentError(
            f"unknown environment {name!r}; built-in environments: "
            f"{', '.join(list_environments())} (or use 'package.module:Class' for your own)"
        )
    return cls


def _import_class(name: str) -> Callable[..., Any]:
    return import_entrypoint(name, "environment", want="a class")


def _check_methods(name: str, obj: Any) -> None:
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(
            f"environment {name!r}: {getattr(obj, '__name__', type(obj).__name__)} has no "
            f"{' or '.join(missing)} method; an environment needs reset(item) and step(text)"
        )


def _check_accepts(name: str, cls: Callable[..., Any], params: Mapping[str, Any]) -> None:
    """Name the offending param rather than fail with Python's TypeError at construction."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature
        return
    try:
        sig.bind(**params)
    except TypeError as exc:
        accepted = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        raise ValueError(
            f"environment {name!r}: invalid params {sorted(params)}: {exc}; "
            f"it accepts: {', '.join(accepted) or 'no params'}"
        ) from None
