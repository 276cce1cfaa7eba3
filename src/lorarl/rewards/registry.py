"""Reward registry: names in a job spec -> callables the trainer can score completions with.

A reward function has lorarl's signature

    fn(prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any],
       **params) -> float | RewardResult | dict

or verl's, recognised by its parameter names (data_source, solution_str, extra_info are names
lorarl's signature never uses) and called by keyword like verl calls it:

    compute_score(data_source, solution_str, ground_truth, extra_info=None, **params)

A dict return is verl's: `score` is the reward, its other numeric keys are metrics the step
records average (`RewardResult.metrics`).

Keyword parameters come from the job spec (`get_reward("regex_match", pattern=r"^\\d+$")`) and are
bound once, so configuration errors surface when the job is loaded, not mid-training.
A spec is a registered name, `"package.module:function"` or `"path/to/file.py:function"` (a
user's own reward).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorarl.entrypoints import import_entrypoint, split_entrypoint

__all__ = [
    "METRICS_KEY",
    "VERL_ARGS",
    "BoundReward",
    "RewardError",
    "RewardFn",
    "RewardResult",
    "UnknownRewardError",
    "check_reward",
    "get_reward",
    "list_rewards",
    "register",
    "register_factory",
    "score_batch",
    "verl_extra_info",
]

# info[METRICS_KEY]: name -> number, averaged per step into the step record (`reward_metrics`).
# Kept inside info so it crosses the reward service's JSON `infos` unchanged.
METRICS_KEY = "metrics"
# What verl passes its `compute_score`, by keyword, in this order.
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_VERL_ONLY = frozenset({"data_source", "solution_str", "extra_info"})


@dataclass(frozen=True)
class RewardResult:
    """A score plus whatever the reward wants logged (extracted answer, missing keys, ...);
    `info["metrics"]` holds the numbers the step record averages."""

    score: float
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def metrics(self) -> Mapping[str, float]:
        found = self.info.get(METRICS_KEY)
        return found if isinstance(found, Mapping) else {}


class RewardFn(Protocol):
    def __call__(
        self, prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
    ) -> float | RewardResult: ...


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable while scoring."""


class UnknownRewardError(ValueError):
    """A reward name that is neither registered nor `module:function`."""


@dataclass(frozen=True)
class _Entry:
    fn: Callable[..., Any]
    is_factory: bool
    check: Callable[..., None] | None


_REGISTRY: dict[str, _Entry] = {}


@dataclass(frozen=True)
class BoundReward:
    """A reward function with its parameters bound; carries a name for metrics and errors."""

    name: str
    fn: Callable[..., Any]
    params: Mapping[str, Any] = field(default_factory=dict)

    def __call__(
        self, prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
    ) -> float | RewardResult:
        return self.fn(prompt, completion, ground_truth, metadata, **self.params)


def register(
    name: str, *, check: Callable[..., None] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a reward function under `name`; `check(**params)` validates params at bind time."""
    return _registrar(name, is_factory=False, check=check)


def register_factory(
    name: str, *, check: Callable[..., None] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register `factory(**params) -> reward fn`, for rewards that build state once (weighted);
    `check(**params)` validates params without building anything (see `check_reward`)."""
    return _registrar(name, is_factory=True, check=check)


def _registrar(
    name: str, *, is_factory: bool, check: Callable[..., None] | None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    if not name or ":" in name:
        raise ValueError(f"reward name {name!r} must be non-empty and contain no ':'")

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = _Entry(fn=fn, is_factory=is_factory, check=check)
        return fn

    return decorator


def list_rewards() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_reward(spec: str | Callable[..., Any], **params: Any) -> BoundReward:
    """Resolve a built-in name, `"module:function"` or a callable, binding `params` as keywords.

    Raises ValueError for an unknown name, a module/function that can't be found, a non-callable,
    or params the function does not accept.
    """
    if callable(spec):
        name = getattr(spec, "__name__", type(spec).__name__)
        return _bind(name, spec, params)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string or a callable, got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        return _bind(spec, _import_callable(spec), params)
    entry = _entry(spec)
    if entry.is_factory:
        _check_accepts(spec, entry.fn, params, positional=0)
        return BoundReward(name=spec, fn=entry.fn(**params))
    bound = _bind(spec, entry.fn, params)
    if entry.check is not None:
        entry.check(**params)
    return bound


def _entry(name: str) -> _Entry:
    _load_builtins()
    entry = _REGISTRY.get(name)
    if entry is None:
        raise UnknownRewardError(
            f"unknown reward {name!r}; known rewards: {', '.join(sorted(_REGISTRY))} "
            "(or use 'module:function' for your own)"
        )
    return entry


def check_reward(spec: str, params: Mapping[str, Any]) -> None:
    """What `get_reward(spec, **params)` would refuse, found without binding: no factory runs
    (no model loads) and no user module is imported, so `lorarl validate` and the webhook can call
    it. A `module:function` reward lives in the user's image: only the trainer can check it.
    Raises UnknownRewardError for an unknown name, ValueError for refused params."""
    if ":" in spec:
        return
    entry = _entry(spec)
    _check_accepts(spec, entry.fn, params, positional=0 if entry.is_factory else 4)
    if entry.check is not None:
        try:
            entry.check(**params)
        except (TypeError, AttributeError, KeyError) as exc:  # a param of the wrong type
            raise ValueError(f"reward {spec!r}: invalid parameters: {exc}") from None


def _import_callable(spec: str) -> Callable[..., Any]:
    source, attr = split_entrypoint(spec)
    if not source or not attr:
        raise ValueError(f"reward {spec!r}: expected 'module:function' or 'path/file.py:function'")
    return import_entrypoint(spec, "reward")


def _bind(name: str, fn: Callable[..., Any], params: Mapping[str, Any]) -> BoundReward:
    verl = _verl_args(fn)
    if verl is None:
        _check_accepts(name, fn, params, positional=4)
        return BoundReward(name=name, fn=fn, params=dict(params))
    _check_verl_accepts(name, fn, verl, params)
    return BoundReward(name=name, fn=VerlStyle(fn, verl), params=dict(params))


def _verl_args(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The verl arguments `fn` takes when its signature is verl's, else None.

    Bound positionally, verl's `(data_source, solution_str, ground_truth, extra_info)` would
    take lorarl's prompt as its data source and score the prompt, without an error. So a
    function naming any of data_source, solution_str or extra_info is verl's and is called by
    keyword with those of the four it takes (all four with **kwargs, as verl passes them)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {p.name for p in sig.parameters.values() if p.kind in kinds}
    if not named & _VERL_ONLY:
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return VERL_ARGS
    return tuple(a for a in VERL_ARGS if a in named)


def _check_verl_accepts(
    name: str, fn: Callable[..., Any], args: tuple[str, ...], params: Mapping[str, Any]
) -> None:
    called = f"called as fn({', '.join(f'{a}=' for a in VERL_ARGS)} **params)"
    if "solution_str" not in args:
        raise ValueError(
            f"reward {name!r}: a verl-style reward ({called}) must take solution_str, the "
            "completion it scores"
        )
    try:
        inspect.signature(fn).bind(**dict.fromkeys(args), **params)
    except TypeError as exc:
        raise ValueError(
            f"reward {name!r}: a verl-style reward is {called}; with params {sorted(params)}: {exc}"
        ) from exc


def verl_extra_info(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """verl's `extra_info`: the row's `extra_info` column when it has one (verl's preprocessed
    parquet), else every column but the prompt and the answer. A copy: verl's rewards may write
    into it."""
    extra = metadata.get("extra_info")
    return dict(extra) if isinstance(extra, Mapping) else dict(metadata)


@dataclass(frozen=True)
class VerlStyle:
    """A verl `compute_score` behind lorarl's signature: data_source from the row's
    `data_source` column (None without one), the completion as solution_str, the answer key's
    value as ground_truth, `verl_extra_info` as extra_info."""

    fn: Callable[..., Any]
    args: tuple[str, ...]

    def __call__(
        self,
        prompt: str,
        completion: str,
        ground_truth: str | None,
        metadata: Mapping[str, Any],
        **params: Any,
    ) -> Any:
        values = {
            "data_source": metadata.get("data_source"),
            "solution_str": completion,
            "ground_truth": ground_truth,
            "extra_info": verl_extra_info(metadata) if "extra_info" in self.args else None,
        }
        out = self.fn(**{a: values[a] for a in self.args}, **params)
        # verl also takes `async def compute_score`; lorarl's scorers are synchronous
        return asyncio.run(out) if inspect.iscoroutine(out) else out


def _check_accepts(
    name: str, fn: Callable[..., Any], params: Mapping[str, Any], *, positional: int
) -> None:
    """Fail at bind time, naming the offending parameter, rather than on the first batch."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no introspectable signature
        return
    try:
        sig.bind(*([None] * positional), **params)
    except TypeError as exc:
        accepted = [
            p.name
            for p in sig.parameters.values()
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ][positional:]
        raise ValueError(
            f"reward {name!r}: invalid parameters {sorted(params)}: {exc}; "
            f"it accepts: {', '.join(accepted) or 'no parameters'}"
        ) from exc


def to_result(value: Any, name: str = "reward") -> RewardResult:
    """Normalize a reward's return value; non-finite scores are refused (they poison advantages)."""
    if isinstance(value, RewardResult):
        score = value.score
        result = value
    elif isinstance(value, Mapping):
        result = _from_dict(value, name)
        score = result.score
    elif isinstance(value, numbers.Real):  # bool -> 1.0/0.0; numpy scalars welcome
        score = float(value)
        result = RewardResult(score=score)
    else:
        raise RewardError(
            f"reward {name!r} returned {type(value).__name__}; expected a float, a dict with "
            "'score' or a RewardResult"
        )
    if not isinstance(score, numbers.Real):
        raise RewardError(f"reward {name!r} returned a RewardResult with score {score!r}")
    if not math.isfinite(score):
        raise RewardError(f"reward {name!r} returned a non-finite score {score!r}")
    if METRICS_KEY in result.info:
        _check_metrics(result.info[METRICS_KEY], name)
    if type(result.score) is not float:  # plain floats for JSON metrics and torch.tensor
        result = RewardResult(score=float(score), info=result.info)
    return result


def _from_dict(value: Mapping[str, Any], name: str) -> RewardResult:
    """verl's dict return: `score` is the reward; the other keys are kept in info, the finite
    numbers (and booleans, e.g. `acc`) among them as metrics."""
    if "score" not in value:
        keys = ", ".join(sorted(map(str, value))) or "none"
        raise RewardError(
            f"reward {name!r} returned a dict without a 'score' key (keys: {keys}); 'score' is "
            "the reward, the other keys are metrics"
        )
    if METRICS_KEY in value:
        raise RewardError(
            f"reward {name!r} returned a dict with a {METRICS_KEY!r} key, which lorarl reserves: "
            "return each metric as a key beside 'score'"
        )
    score = _number(value["score"])
    if score is None:
        raise RewardError(
            f"reward {name!r} returned score {value['score']!r} ({type(value['score']).__name__}); "
            "expected a number"
        )
    metrics: dict[str, float] = {}
    info: dict[str, Any] = {}
    for key, item in value.items():
        if key == "score":
            continue
        number = _number(item)
        if number is not None and math.isfinite(number):
            metrics[str(key)] = number
        else:  # text (an extracted answer), NaN: kept for the record, not averaged
            info[str(key)] = item
    info[METRICS_KEY] = metrics
    return RewardResult(score, info)


def _number(value: Any) -> float | None:
    """A float for a number, a bool or a numpy/torch scalar; None for anything else."""
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        try:
            inner = item()
        except Exception:
            return None
        return float(inner) if isinstance(inner, numbers.Real) else None
    return None


def _check_metrics(metrics: Any, name: str) -> None:
    ok = isinstance(metrics, Mapping) and all(
        isinstance(k, str) and isinstance(v, numbers.Real) and math.isfinite(v)
        for k, v in metrics.items()
    )
    if not ok:
        raise RewardError(
            f"reward {name!r}: info[{METRICS_KEY!r}] must map names to finite numbers, got "
            f"{metrics!r}"[:300]
        )


def score_batch(
    fn: Callable[..., Any],
    prompts: Sequence[str],
    completions: Sequence[str],
    truths: Sequence[str | None] | None = None,
    metadatas: Sequence[Mapping[str, Any]] | None = None,
) -> list[RewardResult]:
    """Score aligned sequences; `truths`/`metadatas` default to None/{} for every item."""
    n = len(completions)
    truths = [None] * n if truths is None else truths
    metadatas = [{}] * n if metadatas is None else metadatas
    lengths = {
        "prompts": len(prompts),
        "completions": n,
        "truths": len(truths),
        "metadatas": len(metadatas),
    }
    if len(set(lengths.values())) != 1:
        raise ValueError(f"score_batch needs equal lengths, got {lengths}")
    name = str(getattr(fn, "name", None) or getattr(fn, "__name__", "reward"))
    results = []
    for i, (p, c, t, m) in enumerate(zip(prompts, completions, truths, metadatas, strict=True)):
        try:
            value = fn(p, c, t, m)
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(
                f"reward {name!r} failed on item {i}: {type(exc).__name__}: {exc}"
            ) from exc
        results.append(to_result(value, name))
    return results


def _load_builtins() -> None:
    # Imported lazily so registry.py has no import cycle with the modules that register into it.
    from lorarl.rewards.functions import builtin, code, combine, math_answer, reward_model  # noqa: F401
