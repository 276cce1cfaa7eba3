"""PEFT tensor names -> Hugging Face base-weight names.

Engines load Hugging Face checkpoints and stack q/k/v and gate/up themselves, so everything we push
must carry the *unfused* Hugging Face name (`model.layers.0.self_attn.q_proj.weight`). Pushing
engine-internal fused names (`qkv_proj`) or PEFT's wrapper names (`...q_proj.base_layer.weight`) is
the KeyError other RL frameworks hit; this module is the one place that mapping lives.

Embedding LoRA (`lora_embedding_A/B`), DoRA magnitudes and LoRA biases are rejected with
`UnsupportedLoraError`: merged sync would need a different merge rule for each, and no job spec
targets them today.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from lorarl.sync.errors import LoraNameError, MissingLoraPairError, UnsupportedLoraError

PEFT_PREFIX = "base_model.model."
BASE_LAYER = ".base_layer"

# Names that exist only inside engines (vLLM/SGLang stack these at load time).
FUSED_ENGINE_NAMES = frozenset({"qkv_proj", "gate_up_proj"})

# Sibling sets an engine stacks into one parameter: writing one member alone corrupts the others.
FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)

Part = Literal["A", "B"]
T = TypeVar("T")

_LORA_RE = re.compile(r"^(?P<module>.+?)\.lora_(?P<part>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")
_UNSUPPORTED_RE = re.compile(r"\.(lora_embedding_[AB]|lora_magnitude_vector)(\.|$)")


@dataclass(frozen=True)
class LoraName:
    """One parsed LoRA tensor name."""

    module: str  # Hugging Face module name, e.g. model.layers.0.self_attn.q_proj
    part: Part
    adapter: str | None  # None for PEFT-saved names (adapter_model.safetensors)

    @property
    def base_weight_name(self) -> str:
        return f"{self.module}.weight"

    @property
    def peft_name(self) -> str:
        """The name PEFT writes in adapter_model.safetensors (what adapter mode saves)."""
        return peft_lora_name(self.module, self.part)


@dataclass(frozen=True)
class LoraPair(Generic[T]):
    A: T
    B: T


def peft_lora_name(module: str, part: Part) -> str:
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def is_lora_name(name: str) -> bool:
    return ".lora_" in name


def strip_peft(name: str) -> str:
    """Drop PEFT's `base_model.model.` prefix and `.base_layer` wrappers from any tensor name."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(BASE_LAYER, "")


def check_not_fused(module: str, *, allow_fused: bool = False) -> None:
    """Refuse engine-internal fused names unless the checkpoint itself is fused (e.g. Phi-3)."""
    if allow_fused:
        return
    for component in module.split("."):
        if component in FUSED_ENGINE_NAMES:
            raise LoraNameError(
                f"{module!r}: {component!r} is an engine-internal fused name; send Hugging Face "
                "q_proj/k_proj/v_proj (or gate_proj/up_proj) weights and let the engine stack them "
                "(pass allow_fused=True only if the checkpoint itself stores fused weights)"
            )


def parse_lora_name(name: str, *, allow_fused: bool = False) -> LoraName:
    """Parse `base_model.model.<module>[.base_layer].lora_<A|B>[.<adapter>].weight`."""
    if _UNSUPPORTED_RE.search(name):
        raise UnsupportedLoraError(
            f"{name!r}: embedding LoRA and DoRA are not supported by weight sync; "
            "remove embed_tokens from lora.targetModules and disable DoRA"
        )
    match = _LORA_RE.match(name)
    if match is None:
        if is_lora_name(name):
            raise UnsupportedLoraError(
                f"{name!r}: not a lora_A/lora_B weight (LoRA bias is not supported by weight sync)"
            )
        raise LoraNameError(f"{name!r}: not a LoRA tensor name (expected ...lora_A/B.weight)")
    module = strip_peft(match["module"])
    if not module:
        raise LoraNameError(f"{name!r}: empty module name")
    check_not_fused(module, allow_fused=allow_fused)
    return LoraName(module=module, part=match["part"], adapter=match["adapter"])  # type: ignore[arg-type]


def base_weight_name(name: str, *, allow_fused: bool = False) -> str:
    """Hugging Face weight name for a LoRA name or a PEFT-wrapped base name."""
    if is_lora_name(name):
        return parse_lora_name(name, allow_fused=allow_fused).base_weight_name
    stripped = strip_peft(name)
    check_not_fused(stripped, allow_fused=allow_fused)
    return stripped


def group_lora_pairs(
    state_dict: Mapping[str, T], *, adapter: str | None = None, allow_fused: bool = False
) -> dict[str, LoraPair[T]]:
    """Group LoRA tensors by Hugging Face module; non-LoRA entries (base weights) are ignored.

    Accepts both `model.state_dict()` names (with the adapter name) and PEFT-saved names. With
    several adapters in one state dict, `adapter` picks one; mixing them silently would merge
    the wrong matrices.
    """
    parsed_items = [
        (key, parse_lora_name(key, allow_fused=allow_fused), value)
        for key, value in state_dict.items()
        if is_lora_name(key)
    ]
    if adapter is not None:
        parsed_items = [it for it in parsed_items if it[1].adapter in (adapter, None)]
    adapters = {p.adapter for _, p, _ in parsed_items}
    if len(adapters) > 1:
        names = sorted(str(a) for a in adapters)
        raise LoraNameError(f"state dict mixes adapters {names}; pass adapter= to pick one")
    halves: dict[str, dict[str, T]] = {}
    for key, parsed, value in parsed_items:
        slot = halves.setdefault(parsed.module, {})
        if parsed.part in slot:
            raise LoraNameError(f"{key!r}: second lora_{parsed.part} for module {parsed.module!r}")
        slot[parsed.part] = value
    pairs: dict[str, LoraPair[T]] = {}
    for module, slot in halves.items():
        missing = [p for p in ("A", "B") if p not in slot]
        if missing:
            raise MissingLoraPairError(
                f"module {module!r} has lora_{'/'.join(sorted(slot))} but no lora_{missing[0]}"
            )
        pairs[module] = LoraPair(A=slot["A"], B=slot["B"])
    return pairs


def _sibling_set(leaf: str) -> tuple[str, ...] | None:
    for siblings in FUSED_SIBLINGS:
        if leaf in siblings:
            return siblings
    return None


def fused_groups(
    module_names: Iterable[str], *, known_modules: Iterable[str] | None = None
) -> list[tuple[str, ...]]:
    """Partition targeted modules into the sets an engine must receive together.

    vLLM and SGLang stack q/k/v and gate/up of a layer into one parameter; loading q alone leaves
    k/v garbage. So a group holds *every* sibling of a targeted module, targeted or not: the
    sidecar sends untargeted siblings' pristine base weights alongside. `known_modules` (the base
    checkpoint's modules) drops siblings an architecture does not have. Unfused modules are
    groups of one. Order follows first appearance in `module_names`.
    """
    known = set(known_modules) if known_modules is not None else None
    groups: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for module in module_names:
        if module in seen:
            continue
        check_not_fused(module)
        parent, _, leaf = module.rpartition(".")
        siblings = _sibling_set(leaf)
        if siblings is None:
            group: tuple[str, ...] = (module,)
        else:
            prefix = f"{parent}." if parent else ""
            group = tuple(
                f"{prefix}{s}"
                for s in siblings
                if f"{prefix}{s}" == module or known is None or f"{prefix}{s}" in known
            )
        seen.update(group)
        groups.append(group)
    return groups


def modules_to_send(
    module_names: Iterable[str], *, known_modules: Iterable[str] | None = None
) -> list[str]:
    """Targeted modules plus their fused siblings, flattened in group order."""
    return [m for g in fused_groups(module_names, known_modules=known_modules) for m in g]
