"""`spec.lora`: the policy's LoRA adapter.

With `adapterPath` the adapter's own `adapter_config.json` (PEFT's file) says its rank, alpha,
targets, dropout and rsLoRA scaling: a field left unset takes the adapter's value, a field set to
a different value is refused (`merge_adapter_config`, a pure function over the parsed file). Without
an adapter an unset field takes the default below. The trainer applies the merge when it loads the
adapter; `lorarl validate --deep` and the rollout sidecar apply it when the file is readable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra

ALL_LINEAR = "all-linear"
DEFAULT_RANK = 32
DEFAULT_ALPHA = 32.0
DEFAULT_DROPOUT = 0.0
DEFAULT_TARGET_MODULES = (ALL_LINEAR,)
ADAPTER_CONFIG = "adapter_config.json"

_ALL_LINEAR_ALONE = Rule(
    cel="!has(self.targetModules) || !('all-linear' in self.targetModules) || "
    "size(self.targetModules) == 1",
    message="'all-linear' cannot be combined with other module names",
    check=lambda m: (
        m.target_modules is None or ALL_LINEAR not in m.target_modules or len(m.target_modules) == 1
    ),
    field="targetModules",
)
_UNSET = "Unset: the adapter's value with adapterPath, else "


class LoraSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_ALL_LINEAR_ALONE))

    rank: int | None = Field(
        default=None, gt=0, le=1024, description=f"LoRA rank r. {_UNSET}{DEFAULT_RANK}."
    )
    alpha: float | None = Field(
        default=None,
        gt=0,
        le=65536,
        description=f"LoRA alpha; the update is scaled by alpha/r. {_UNSET}{DEFAULT_ALPHA:g}.",
    )
    dropout: float | None = Field(
        default=None,
        ge=0,
        lt=1,
        description="Dropout on the LoRA input, written to the exported adapter's config for a "
        "later supervised fine-tune. Not applied during RL: the engines sample without dropout, "
        f"so every trainer pass runs without it (as TRL and verl do). {_UNSET}{DEFAULT_DROPOUT:g}.",
    )
    target_modules: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="Modules to adapt: ['all-linear'] (every linear layer but the output head, "
        "as 'LoRA Without Regret' advises) or a list of module names such as q_proj, v_proj. "
        f"{_UNSET}['all-linear'].",
    )
    exclude_modules: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Module names to leave without LoRA (with adapterPath and targetModules "
        "unset, empty takes the adapter's).",
    )
    use_rslora: bool | None = Field(
        default=None,
        description=f"Rank-stabilized LoRA: scale by alpha/sqrt(r) instead. {_UNSET}false.",
    )
    adapter_path: str | None = Field(
        default=None,
        description="Start from this existing PEFT adapter folder. Its adapter_config.json "
        "supplies rank, alpha, dropout, targetModules and useRslora left unset here; rank, "
        "alpha or useRslora set here to a different value is refused (dropout set here wins).",
    )

    _rules = enforce(_ALL_LINEAR_ALONE)

    def values(self, adapter_config: Mapping[str, Any] | None = None) -> LoraValues:
        """Every setting, unset ones from `adapter_config` (the adapter's parsed file, when
        there is one and it was read) or else the defaults."""
        return merge_adapter_config(self, adapter_config)


@dataclass(frozen=True)
class LoraValues:
    """spec.lora with every setting decided."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    exclude_modules: tuple[str, ...]
    use_rslora: bool
    adapter_path: str | None


class AdapterConfigError(ValueError):
    """The adapter's config disagrees with a field the spec sets, or cannot be used."""


# spec field (camelCase), Python attribute, PEFT key, type the PEFT value must have
_SCALARS: tuple[tuple[str, str, str, type | tuple[type, ...]], ...] = (
    ("rank", "rank", "r", int),
    ("alpha", "alpha", "lora_alpha", (int, float)),
    ("dropout", "dropout", "lora_dropout", (int, float)),
    ("useRslora", "use_rslora", "use_rslora", bool),
)
# Settings that change neither the adapter's weights nor its scale: the spec's value wins.
_OVERRIDABLE = frozenset({"dropout"})


def _module_names(value: Any, key: str, where: str) -> tuple[str, ...] | None:
    """PEFT's target/exclude modules as names: a list, 'all-linear', or None. A regular
    expression has no spec equivalent."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return (ALL_LINEAR,)
        raise AdapterConfigError(
            f"{where} selects {key} by the pattern {value!r}: set spec.lora.targetModules "
            "to the module names it adapts"
        )
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(sorted(value))
    raise AdapterConfigError(f"{where} has {key}={value!r}, not a list of module names")


def merge_adapter_config(lora: LoraSpec, adapter: Mapping[str, Any] | None) -> LoraValues:
    """The spec's LoRA settings completed from the adapter's parsed `adapter_config.json`.

    A scalar the spec sets must equal the adapter's (dropout excepted: it is not in the
    weights, and RL runs without it). Target modules are not compared here:
    'all-linear' and a list of names can mean the same modules, which only the model can tell
    (the trainer's `check_adapter_matches` compares the resolved modules).
    """
    where = f"the adapter at {lora.adapter_path}"
    taken: dict[str, Any] = {}
    for field, attr, key, kind in _SCALARS:
        mine = getattr(lora, attr)
        theirs = None if adapter is None else adapter.get(key)
        if theirs is not None and (
            not isinstance(theirs, kind) or (kind is not bool and isinstance(theirs, bool))
        ):
            raise AdapterConfigError(f"{where} has {key}={theirs!r}, not a {field} value")
        if mine is not None and theirs is not None and mine != theirs and attr not in _OVERRIDABLE:
            shown = str(mine).lower() if isinstance(mine, bool) else f"{mine:g}"
            raise AdapterConfigError(
                f"spec.lora.{field}: {shown} but {where} says {key}={json.dumps(theirs)}"
            )
        taken[attr] = mine if mine is not None else theirs
    targets: tuple[str, ...] | None = None
    excludes = tuple(lora.exclude_modules)
    if lora.target_modules is not None:
        targets = tuple(lora.target_modules)
    elif adapter is not None:
        targets = _module_names(adapter.get("target_modules"), "target_modules", where)
        if not excludes:
            excludes = _module_names(adapter.get("exclude_modules"), "exclude_modules", where) or ()
    rank = taken["rank"] if taken["rank"] is not None else DEFAULT_RANK
    if rank <= 0:
        raise AdapterConfigError(f"{where} has r={rank}, not a LoRA rank")
    return LoraValues(
        rank=rank,
        alpha=float(taken["alpha"]) if taken["alpha"] is not None else DEFAULT_ALPHA,
        dropout=float(taken["dropout"]) if taken["dropout"] is not None else DEFAULT_DROPOUT,
        target_modules=targets or DEFAULT_TARGET_MODULES,
        exclude_modules=excludes,
        use_rslora=bool(taken["use_rslora"]),
        adapter_path=lora.adapter_path,
    )


def read_adapter_config(adapter_path: str | Path) -> dict[str, Any]:
    """The adapter folder's `adapter_config.json`, parsed; refuses a non-LoRA adapter."""
    cfg_file = Path(adapter_path) / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise AdapterConfigError(f"lora.adapterPath {adapter_path} has no {ADAPTER_CONFIG}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterConfigError(f"{cfg_file} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise AdapterConfigError(f"{cfg_file} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterConfigError(f"{cfg_file} is a {raw.get('peft_type')} adapter, not LORA")
    return raw


def values_here(lora: LoraSpec) -> LoraValues:
    """The settings as far as this machine can tell: merged with the adapter's config when its
    folder is here, else unset fields at their defaults (a cluster's adapter sits on a volume
    the trainer reads; the trainer merges it at start)."""
    path = lora.adapter_path
    if path and (Path(path) / ADAPTER_CONFIG).is_file():
        return lora.values(read_adapter_config(path))
    return lora.values()


def rank_here(lora: LoraSpec) -> int | None:
    """The rank as far as this machine can tell; None when it is an adapter's whose folder is
    not here (the trainer, which reads it, puts it in every update's header)."""
    path = lora.adapter_path
    if lora.rank is None and path and not (Path(path) / ADAPTER_CONFIG).is_file():
        return None
    return values_here(lora).rank
