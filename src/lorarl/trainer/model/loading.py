"""Base model loading and the LoRA adapter around it (PEFT), sharded or not.

Only LoRA tensors ever leave this module: they are what the optimizer steps, what sync ships and
what checkpoints store. The base weights stay frozen, so the reference policy is the same model with
the adapter disabled.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.tuners_utils import check_target_module_exists
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.lora import AdapterConfigError, LoraValues
from lorarl.api.spec.lora import read_adapter_config as read_adapter_file

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
ALL_LINEAR = "all-linear"
ADAPTER_NAME = "default"


class ModelLoadError(RuntimeError):
    """The base model folder is missing or unusable."""


class AdapterError(ValueError):
    """An existing adapter does not match the job's LoRA spec, or cannot be read."""


def load_base_model(
    path: str | Path,
    dtype: Literal["float32", "bfloat16", "float16"] = "float32",
    device: str | torch.device = "cpu",
    *,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a local Hugging Face causal LM folder (config.json + *.safetensors); with
    `trust_remote_code` (model.trustRemoteCode) its own modeling code may run."""
    path = Path(path)
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} does not exist or is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model path {path} has no config.json (not a Hugging Face model)")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model path {path} has no *.safetensors weights")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model from {path}: {exc}") from exc
    contiguous_head_input(model)
    # transformers wraps `to` with @wraps(nn.Module.to), so mypy sees the unbound signature
    return model.to(device)  # type: ignore[arg-type]


def _contiguous_first_arg(module: nn.Module, args: tuple) -> tuple:
    return (args[0].contiguous(), *args[1:]) if args else args


def contiguous_head_input(model: PreTrainedModel) -> None:
    """Hand the LM head a contiguous input.

    With `logits_to_keep` the model slices the last N positions out of the hidden states, a
    non-contiguous view, and `F.linear` on a non-contiguous 3-D input broadcasts the
    [vocab, hidden] weight into a batched matmul: one copy of the whole head per sample, twice
    per micro-batch. Measured on SmolLM2-135M (vocab 49k), 32 samples of 64 tokens, 2 cores:
    update 9.1 s -> 5.6 s in bf16, 8.7 s -> 7.8 s in fp32 (docs/architecture.md, Measured facts).
    """
    head = model.get_output_embeddings()
    if isinstance(head, nn.Module):
        head.register_forward_pre_hook(_contiguous_first_arg)


@dataclass
class LoraSettings:
    """The trainer's view of the job's `lora` section."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = ALL_LINEAR
    exclude_modules: list[str] = field(default_factory=list)
    use_rslora: bool = False
    adapter_path: str | None = None

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"lora.rank must be > 0, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str):
            if self.target_modules != ALL_LINEAR:
                raise ValueError(
                    f"lora.targetModules must be {ALL_LINEAR!r} or a list of module names, "
                    f"got {self.target_modules!r}"
                )
        elif not self.target_modules:
            raise ValueError("lora.targetModules must not be an empty list")

    def to_peft_config(self) -> LoraConfig:
        target = self.target_modules
        return LoraConfig(
            r=self.rank,
            # PEFT annotates lora_alpha as int but only divides by it: a fractional alpha works
            lora_alpha=self.alpha,  # type: ignore[arg-type]
            lora_dropout=self.dropout,
            target_modules=target if isinstance(target, str) else list(target),
            exclude_modules=list(self.exclude_modules) or None,
            use_rslora=self.use_rslora,
            bias="none",
        )


def _linear_module_names(model: nn.Module) -> list[str]:
    """Names PEFT's 'all-linear' expands to: every nn.Linear except the LM head."""
    head = model.get_output_embeddings() if isinstance(model, PreTrainedModel) else None
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head]


def resolve_targets(model: nn.Module, config: LoraConfig) -> set[str]:
    """The set of modules a LoRA config would adapt on this base model, using PEFT's matcher.

    Comparing resolved sets (not raw config values) lets 'all-linear', suffix lists and PEFT's
    expanded full-path lists that mean the same thing compare equal.
    """
    names = _linear_module_names(model)
    cfg = copy.copy(config)
    target = cfg.target_modules
    if isinstance(target, str) and target.lower() == ALL_LINEAR:
        cfg.target_modules = names
    return {n for n in names if bool(check_target_module_exists(cfg, n))}


def read_adapter_config(adapter_path: str | Path) -> LoraConfig:
    try:
        read_adapter_file(adapter_path)  # a clear error for a missing, broken or non-LoRA file
    except AdapterConfigError as exc:
        raise AdapterError(str(exc)) from exc
    return LoraConfig.from_pretrained(str(adapter_path))


def check_adapter_matches(model: nn.Module, settings: LoraSettings, saved: LoraConfig) -> None:
    """Refuse an adapter whose shape or scaling disagrees with the spec: it would train silently
    with a different rank/scale than the job (and the sync sidecars) assume."""
    where = f"adapter at {settings.adapter_path}"
    if saved.r != settings.rank:
        raise AdapterError(f"{where} has rank {saved.r} but lora.rank is {settings.rank}")
    if float(saved.lora_alpha) != float(settings.alpha):
        raise AdapterError(
            f"{where} has alpha {saved.lora_alpha} but lora.alpha is {settings.alpha}"
        )
    if bool(saved.use_rslora) != settings.use_rslora:
        raise AdapterError(
            f"{where} has use_rslora={saved.use_rslora} but lora.useRslora is {settings.use_rslora}"
        )
    want = resolve_targets(model, settings.to_peft_config())
    have = resolve_targets(model, saved)
    if want != have:
        extra, missing = sorted(have - want)[:3], sorted(want - have)[:3]
        raise AdapterError(
            f"{where} targets different modules than lora.targetModules: "
            f"only in adapter {extra}, only in spec {missing}"
        )


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout probability to 0; returns how many modules had p > 0.

    RL scores the policy the engine sampled from, and the engine runs no dropout: with dropout on,
    the old-logprob, reference and update passes each draw a different mask, so the PPO ratio is
    not 1 even when the weights have not moved (clip_frac 0.10/0.17 at dropout 0.05/0.1, lr 0)
    and the gradient is taken for a perturbed policy. TRL (`disable_dropout`) and verl do the
    same. `p = 0` rather than `eval()`: it survives a later `train()` call.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed += 1
    return changed


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> PeftModel:
    """Wrap the base model with a fresh or a resumed LoRA adapter; only LoRA stays trainable.

    Dropout is switched off (see `disable_dropout`); `lora.dropout` is kept in the adapter's
    config, so a later supervised fine-tune of the exported adapter still gets it.
    """
    if settings.adapter_path:
        saved = read_adapter_config(settings.adapter_path)
        check_adapter_matches(model, settings, saved)
        peft_model = PeftModel.from_pretrained(model, settings.adapter_path, is_trainable=True)
    else:
        peft_model = get_peft_model(model, settings.to_peft_config())
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    stray = [n for n in trainable if adapter_of(n) != ADAPTER_NAME]
    if stray or not trainable:
        raise RuntimeError(
            f"after applying LoRA expected only LoRA parameters to be trainable; "
            f"got {len(trainable)} trainable, non-LoRA: {stray[:3]}"
        )
    if disable_dropout(peft_model) and settings.dropout > 0:
        log.warning(
            "lora.dropout=%g is not applied during RL (the engines sample without dropout, so "
            "every logprob pass runs without it); it is kept in the exported adapter config",
            settings.dropout,
        )
    n_train, n_total = count_parameters(peft_model)
    log.info(
        "LoRA r=%d alpha=%s: %d trainable / %d parameters (%.3f%%)",
        settings.rank,
        settings.alpha,
        n_train,
        n_total,
        100.0 * n_train / max(n_total, 1),
    )
    return peft_model


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) element counts, using global shapes for sharded (DTensor) parameters."""
    trainable = total = 0
    for p in model.parameters():
        n = p.numel()  # DTensor.numel() is the global size
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def adapter_of(name: str) -> str | None:
    """The PEFT adapter a parameter name belongs to (`...lora_A.<adapter>.weight`), or None for
    a non-LoRA parameter. With a critic on the same base, a bare ".lora_" test would mix the
    actor's and the critic's tensors."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def lora_parameters(
    model: nn.Module, adapter: str = ADAPTER_NAME
) -> list[tuple[str, nn.Parameter]]:
    """One adapter's LoRA parameters (the actor's by default) in a fixed order: collectives over
    them must run in the same order on every rank."""
    return [(n, p) for n, p in model.named_parameters() if adapter_of(n) == adapter]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def lora_config(model: PeftModel, adapter: str = ADAPTER_NAME) -> LoraConfig:
    """The adapter's config; PEFT types `peft_config` as the generic PeftConfig."""
    config = model.peft_config[adapter]
    if not isinstance(config, LoraConfig):
        raise AdapterError(f"adapter {adapter!r} is a {type(config).__name__}, not LoRA")
    return config


def lora_state_dict(model: PeftModel, adapter: str = ADAPTER_NAME) -> dict[str, torch.Tensor]:
    """Full (unsharded) LoRA tensors of one adapter (the actor's by default) with PEFT file
    names, on CPU, fp32-or-native dtype.

    Collective under FSDP2: every rank must call it (a rank-0-only `full_tensor()` hangs).
    """
    params = lora_parameters(model, adapter)
    gathered = {n: _full(p.detach()).cpu().contiguous() for n, p in params}
    return get_peft_model_state_dict(model, state_dict=gathered, adapter_name=adapter)


def peft_to_param_names(model: PeftModel, adapter: str = ADAPTER_NAME) -> dict[str, str]:
    """PEFT file name -> model parameter name (the file format drops the adapter name)."""
    marker = f".{adapter}."
    return {n.replace(marker, ".", 1): n for n, _ in lora_parameters(model, adapter)}


def set_lora_state_dict(
    model: PeftModel, tensors: Mapping[str, torch.Tensor], adapter: str = ADAPTER_NAME
) -> None:
    """Copy full PEFT-named LoRA tensors into one adapter of the (possibly sharded) model.

    Every rank must hold the same full tensors; each keeps only its own shard, without
    communication.
    """
    names = peft_to_param_names(model, adapter)
    missing = sorted(set(names) - set(tensors))
    unexpected = sorted(set(tensors) - set(names))
    if missing or unexpected:
        raise AdapterError(
            f"{adapter!r} LoRA tensors do not fit the model: "
            f"missing {missing[:3]} ({len(missing)}), "
            f"unexpected {unexpected[:3]} ({len(unexpected)})"
        )
    params = dict(model.named_parameters())
    for peft_name, param_name in names.items():
        copy_full_into(params[param_name], tensors[peft_name], peft_name)


def copy_full_into(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Copy a full tensor into a parameter, keeping only this rank's shard of a DTensor."""
    if tuple(full.shape) != tuple(param.shape):
        raise AdapterError(
            f"{name}: shape {tuple(full.shape)} does not match model {tuple(param.shape)}"
        )
    with torch.no_grad():
        if isinstance(param, DTensor):
            local = full.to(device=param.to_local().device, dtype=param.dtype)
            mesh, placements = param.device_mesh, param.placements
            shard = distribute_tensor(local, mesh, placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full.to(device=param.device, dtype=param.dtype))


def lora_values(job: LoRARLJob) -> LoraValues:
    """spec.lora with every setting decided: with adapterPath, the unset ones from the adapter's
    adapter_config.json (read here, so a missing or conflicting adapter stops the start)."""
    lora = job.spec.lora
    try:
        return lora.values(read_adapter_file(lora.adapter_path) if lora.adapter_path else None)
    except AdapterConfigError as exc:
        raise AdapterError(str(exc)) from exc


def lora_settings_of(values: LoraValues) -> LoraSettings:
    """Decided spec.lora values as PEFT's settings (\"all-linear\" stays PEFT's keyword)."""
    targets = list(values.target_modules)
    return LoraSettings(
        rank=values.rank,
        alpha=values.alpha,
        dropout=values.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
        exclude_modules=list(values.exclude_modules),
        use_rslora=values.use_rslora,
        adapter_path=values.adapter_path,
    )


def lora_settings(job: LoRARLJob) -> LoraSettings:
    """spec.lora as the trainer applies it (`lora_values`)."""
    return lora_settings_of(lora_values(job))
