"""`lorarl validate --deep`, the model's part: what the job asks of its model, adapter and data,
checked against the model's own config, module names and tokenizer and the data's rows, without
loading a weight (the model is built on PyTorch's meta device: names and shapes, no memory).

Each check is the trainer's or the engines' own, run before any pod or process starts:
the LoRA target and exclude names against the model's modules (PEFT's suffix match), the
rollout's tensor parallelism against the attention heads (vLLM and SGLang split heads across
ranks), an existing adapter's shape (`check_adapter_matches`), the rows' prompt and answer keys
(`PromptDataset`) and their lengths against `data.maxPromptTokens` (`drop_long_prompts`).

A cluster job's files live on its volumes, usually not on this machine: what is not here is
skipped (the trainer checks it at start; `lorarl run --local`'s preflight names a local run's
missing model, adapter or data file before anything starts).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lorarl.api.resource import LoRARLJob
from lorarl.plan.memory import (
    DEFAULT_GPU_MEMORY,
    MemoryPlan,
    ModelShape,
    estimate,
    read_config,
    settings_of,
)

# Prompts measured per data source: an evenly spaced sample beyond this (tokenizing a whole
# large dataset would take minutes; the trainer measures every prompt at start).
MAX_MEASURED_PROMPTS = 5000
MAX_NAMES_SHOWN = 12


class _Unloadable(Exception):
    pass


def model_dir(job: LoRARLJob) -> Path:
    """Where the model is on this machine: its folder, or for a hub id the snapshot the user's
    hub cache holds (looked up without the network); it may not exist."""
    model = job.spec.model
    if model.from_hub:
        from lorarl.hub import cached

        snapshot = cached(model.path, revision=model.revision)
        if snapshot is not None:
            return snapshot.path
    return Path(model.path)


def model_problems(job: LoRARLJob, *, cluster: bool) -> list[str]:
    """One line per problem, each naming the field. `cluster` is unused: what is not here is
    skipped for every job (`lorarl run --local` names a local run's missing file before it
    starts; a hub id not in the hub cache is fetched then), what is here is checked alike."""
    path = model_dir(job)
    problems: list[str] = []
    tokenizer = None
    if path.is_dir():
        remote = job.spec.model.trust_remote_code
        try:
            config, model = _meta_model(path, remote)
            problems += parallel_problems(job, config) + lora_problems(job, model)
            tokenizer = _tokenizer(path, remote)
        except _Unloadable as exc:
            problems.append(f"spec.model.path: {exc}")
    return problems + data_problems(job, tokenizer)


def _tokenizer(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise _Unloadable(f"cannot load the tokenizer from {path}: {exc}") from exc


def _meta_model(path: Path, trust_remote_code: bool) -> tuple[Any, Any]:
    """The model's config and its module tree on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise _Unloadable(f"{path} has no config.json (not a Hugging Face model)")
    if not any(path.glob("*.safetensors")):
        raise _Unloadable(f"{path} has no *.safetensors weights")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise _Unloadable(f"cannot read the model at {path}: {exc}") from exc
    return config, model


def parallel_problems(job: LoRARLJob, config: Any) -> list[str]:
    """vLLM and SGLang give each tensor-parallel rank a whole number of attention heads, and
    each a key-value head (split, or replicated when there are fewer than ranks)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    tp = job.spec.rollout.tensor_parallel_size
    where = "spec.rollout.tensorParallelSize"
    if isinstance(heads, int) and heads % tp:
        return [f"{where}: must divide the model's {heads} attention heads (got {tp})"]
    if isinstance(kv, int) and kv % tp and tp % kv:
        return [
            f"{where}: must divide the model's {kv} key-value heads or be a multiple of them "
            f"(got {tp})"
        ]
    return []


def _suffixes(names: Sequence[str]) -> str:
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    more = f", ... ({len(short)} names)" if len(short) > MAX_NAMES_SHOWN else ""
    return ", ".join(short[:MAX_NAMES_SHOWN]) + more


def _matches(name: str, modules: Sequence[str]) -> list[str]:
    """PEFT's rule for a list of target names: the module's full name, or its dotted suffix."""
    return [m for m in modules if m == name or m.endswith(f".{name}")]


def lora_problems(job: LoRARLJob, model: Any) -> list[str]:
    from peft import LoraConfig

    from lorarl.api.spec.lora import AdapterConfigError
    from lorarl.api.spec.lora import read_adapter_config as read_adapter_file
    from lorarl.trainer.model.loading import (
        ALL_LINEAR,
        AdapterError,
        check_adapter_matches,
        lora_settings_of,
        read_adapter_config,
        resolve_targets,
    )

    modules = [name for name, _ in model.named_modules() if name]
    linear = resolve_targets(model, LoraConfig(target_modules=ALL_LINEAR))
    kinds = dict(model.named_modules())
    problems = []
    actor = job.spec.lora
    sections = [("spec.lora", actor.target_modules or [], actor.exclude_modules)]
    if job.spec.critic is not None:  # its unset lists are the actor's, checked already
        own = job.spec.critic.lora
        sections.append(("spec.critic.lora", own.target_modules or [], own.exclude_modules or []))
    for where, targets, excludes in sections:
        for name in targets:
            if name == ALL_LINEAR:
                continue
            found = _matches(name, modules)
            if not found:
                problems.append(
                    f"{where}.targetModules: {name} names no module of the model (its linear "
                    f"layers: {_suffixes(sorted(linear))})"
                )
            elif not any(m in linear for m in found):
                kind = type(kinds[found[0]]).__name__
                problems.append(
                    f"{where}.targetModules: {name} names {kind} modules, not linear layers "
                    f"(LoRA adapts linear layers: {_suffixes(sorted(linear))})"
                )
        for name in excludes:
            if not _matches(name, modules):
                problems.append(
                    f"{where}.excludeModules: {name} names no module of the model (its linear "
                    f"layers: {_suffixes(sorted(linear))})"
                )
    if problems:
        return problems
    lora = job.spec.lora
    path = lora.adapter_path if lora.adapter_path and Path(lora.adapter_path).is_dir() else None
    adapter = None
    if path:
        try:
            adapter = read_adapter_file(path)
        except AdapterConfigError as exc:
            return [f"spec.lora.adapterPath: {exc}"]
    try:  # a field set here that the adapter's config contradicts names itself
        settings = lora_settings_of(lora.values(adapter))
    except AdapterConfigError as exc:
        return [str(exc) if str(exc).startswith("spec.") else f"spec.lora.adapterPath: {exc}"]
    if not resolve_targets(model, settings.to_peft_config()):
        return ["spec.lora.excludeModules: leaves no layer of targetModules to adapt"]
    if path:
        try:
            check_adapter_matches(model, settings, read_adapter_config(path))
        except (AdapterError, ValueError, TypeError) as exc:
            return [f"spec.lora.adapterPath: {exc}"]
    return []


def data_problems(job: LoRARLJob, tokenizer: Any | None) -> list[str]:
    """The rows as the trainer reads them (keys, prompt shapes) and, with the model's tokenizer,
    whether any prompt fits `data.maxPromptTokens` once rendered with the chat template (longer
    ones are dropped)."""
    from lorarl.trainer.data.files import DataError
    from lorarl.trainer.data.prompts import PromptDataset, drop_long_prompts

    data = job.spec.data
    problems = []
    for key, files in (("trainFiles", data.train_files), ("valFiles", data.val_files)):
        here = [f for f in files if "://" not in f and Path(f).exists()]
        if not here:
            continue
        try:
            loaded = PromptDataset.from_files(
                here, data.prompt_key, data.answer_key, system_prompt=data.system_prompt,
                chat_template_kwargs=data.chat_template_kwargs,
            )  # fmt: skip
        except (OSError, ValueError) as exc:  # DataError: a key or a row the trainer refuses
            problems.append(f"spec.data.{key}: {exc}")
            continue
        if tokenizer is None:
            continue
        stride = -(-len(loaded) // MAX_MEASURED_PROMPTS)
        sample = PromptDataset(list(loaded)[::stride], loaded.source, loaded.chat_template_kwargs)
        try:
            drop_long_prompts(sample, tokenizer, data.max_prompt_tokens)
        except DataError as exc:
            of = f" (measured {len(sample)} of {len(loaded)})" if stride > 1 else ""
            problems.append(f"spec.data.maxPromptTokens: {exc}{of}")
    return problems


def model_shape(config: dict[str, Any], lora: Any, critic_rank: int | None = None) -> ModelShape:
    """Sizes from the config; parameter counts from the model and its adapter built on the meta
    device with the trainer's LoRA settings (`trainer.settings.LoraSettings`: PEFT resolves the
    targets as the trainer's does). `critic_rank`: ppo's critic adapter and value head (counted
    with the actor's targets)."""
    import warnings
    from dataclasses import replace

    import torch
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorarl.trainer.model.parallel import decoder_layers

    fields = dict(config)
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        base = AutoModelForCausalLM.from_config(cfg)
        params = sum(p.numel() for p in base.parameters())
        peft = get_peft_model(base, replace(lora, adapter_path=None).to_peft_config())
    layer = decoder_layers(peft)[0]
    layer_params = sum(p.numel() for n, p in layer.named_parameters() if "lora_" not in n)
    adapter = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
    ranks = sum(m.r["default"] for m in layer.modules() if isinstance(m, LoraLayer))
    critic = 0
    if critic_rank is not None:
        critic = adapter * critic_rank // lora.rank + text.hidden_size + 1
    heads = text.num_attention_heads
    return ModelShape(
        hidden=text.hidden_size,
        intermediate=text.intermediate_size,
        layers=text.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        params=params,
        layer_params=layer_params,
        lora_params=adapter,
        lora_ranks_per_layer=ranks,
        critic_params=critic,
    )


def plan_memory(
    job: LoRARLJob,
    config: str | Path | dict[str, Any] | None = None,
    gpu_memory: int = DEFAULT_GPU_MEMORY,
) -> MemoryPlan:
    """The job's memory plan (`plan.memory`); `config`: the model's config.json (default:
    spec.model.path's). Here, not in `plan`, because the shape is counted with the trainer's
    own code, and `plan` sits below the trainer (docs/architecture.md, Layers)."""
    from lorarl.api.spec.lora import values_here
    from lorarl.trainer.model.loading import lora_settings_of

    source = model_dir(job) if config is None else config
    try:
        data = read_config(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the model's config.json from {source}: {exc}") from exc
    critic = job.spec.critic
    lora = lora_settings_of(values_here(job.spec.lora))  # an adapter's rank, when it is here
    critic_rank = None if critic is None else (critic.lora.rank or lora.rank)
    shape = model_shape(data, lora, critic_rank)
    return estimate(shape, settings_of(job), gpu_memory)
