"""`weighted`: one reward from several, e.g. correctness + 0.1 * format - 0.05 * length."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lorarl.rewards.registry import (
    METRICS_KEY,
    BoundReward,
    RewardResult,
    check_reward,
    get_reward,
    register_factory,
    to_result,
)

__all__ = ["weighted"]

Component = (
    tuple[str | Callable[..., Any], float]
    | tuple[str | Callable[..., Any], float, Mapping[str, Any]]
    | Mapping[str, Any]
)


def _parse_component(i: int, comp: Component) -> tuple[BoundReward, float]:
    spec, weight, params = _split(i, comp)
    return get_reward(spec, **params), weight


def _split(i: int, comp: Component) -> tuple[Any, float, Mapping[str, Any]]:
    if isinstance(comp, Mapping):  # the form a YAML job spec gives: {name, weight, params}
        unknown = set(comp) - {"name", "weight", "params"}
        if unknown or "name" not in comp:
            raise ValueError(
                f"weighted: component {i} must have keys name, weight[, params]; got {sorted(comp)}"
            )
        spec, weight, params = comp["name"], comp.get("weight", 1.0), comp.get("params") or {}
    elif isinstance(comp, (tuple, list)) and len(comp) in (2, 3):
        spec, weight = comp[0], comp[1]
        params = comp[2] if len(comp) == 3 else {}
    else:
        raise ValueError(
            f"weighted: component {i} must be (name_or_fn, weight[, params]), got {comp!r}"
        )
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ValueError(f"weighted: component {i} weight must be a finite number, got {weight!r}")
    if not isinstance(params, Mapping):
        raise ValueError(f"weighted: component {i} params must be a mapping, got {params!r}")
    return spec, float(weight), params


def _check(components: Sequence[Component]) -> None:
    """Each component's shape, name and params, with nothing bound (see check_reward)."""
    if isinstance(components, (str, bytes)) or not isinstance(components, Sequence):
        raise ValueError("weighted: components must be a non-empty list")
    if not components:
        raise ValueError("weighted: components must be a non-empty list")
    for i, comp in enumerate(components):
        spec, _, params = _split(i, comp)
        if not isinstance(spec, str):
            raise ValueError(f"weighted: component {i} name must be a string, got {spec!r}")
        try:
            check_reward(spec, params)
        except ValueError as exc:  # an unknown name here is a bad param of weighted
            raise ValueError(f"weighted: component {i}: {exc}") from None


@register_factory("weighted", check=_check)
def weighted(components: Sequence[Component]) -> Callable[..., RewardResult]:
    """Sum of weight * score over components; each component's score is kept in info, and its
    metrics become the sum's as `<component>/<name>` (so they still reach the step record)."""
    if isinstance(components, (str, bytes)) or not components:
        raise ValueError("weighted: components must be a non-empty list")
    parts = [_parse_component(i, c) for i, c in enumerate(components)]
    labels: list[str] = []
    for reward, _ in parts:
        label, n = reward.name, 2
        while label in labels:  # the same reward twice with different params
            label, n = f"{reward.name}#{n}", n + 1
        labels.append(label)

    def combined(
        prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult:
        scores: dict[str, float] = {}
        infos: dict[str, Any] = {}
        metrics: dict[str, float] = {}
        total = 0.0
        for label, (reward, weight) in zip(labels, parts, strict=True):
            result = to_result(reward(prompt, completion, ground_truth, metadata), label)
            scores[label] = result.score
            if result.info:
                infos[label] = result.info
            metrics.update({f"{label}/{k}": v for k, v in result.metrics.items()})
            total += weight * result.score
        info: dict[str, Any] = {"components": scores, "component_info": infos}
        if metrics:
            info[METRICS_KEY] = metrics
        return RewardResult(total, info)

    return combined
