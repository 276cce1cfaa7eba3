"""What a finished run leaves behind (`training.export`): the PEFT adapter, and optionally a
merged Hugging Face model folder that serves without LoRA support.

The merged model is built on rank 0 from the gathered full LoRA tensors and a fresh fp32 load of
the base (the training copy may be sharded and is in the training dtype): the delta `B @ A` is
added in fp32 and the result cast once to `model.dtype`, the dtype the engines serve. This costs
one fp32 copy of the base in rank 0's CPU memory, once, at the end. Like checkpoints, the folder
is written under a temp name and renamed into place.

A PPO run also leaves its critic in `critic/` beside the adapter folder (the critic's own PEFT
adapter, `value_head.safetensors` and a `critic.json` saying what it is), so the adapter folder
stays a plain PEFT adapter an engine can load.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from lorarl.trainer.checkpoint.files import run_on_rank0, write_dir_atomically
from lorarl.trainer.checkpoint.manager import export_adapter
from lorarl.trainer.model.critic import (
    critic_config,
    critic_state_dict,
    has_critic,
    write_critic_dir,
)
from lorarl.trainer.model.loading import (
    ADAPTER_NAME,
    DTYPES,
    load_base_model,
    lora_config,
    lora_state_dict,
    set_lora_state_dict,
)

__all__ = ["CRITIC_EXPORT_DIR", "MERGED_DIR", "export_critic", "export_final", "export_merged",
           "merge_lora"]  # fmt: skip

log = logging.getLogger(__name__)

MERGED_DIR = "merged"
CRITIC_EXPORT_DIR = "critic"


def merge_lora(
    base_path: str | Path,
    config: LoraConfig,
    tensors: dict[str, Any],
    dtype: str = "float32",
    *,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """The base model at `base_path` with the LoRA `tensors` (PEFT file names) merged in."""
    base = load_base_model(base_path, "float32", trust_remote_code=trust_remote_code)
    cfg = copy.deepcopy(config)
    cfg.inference_mode = True
    peft_model = get_peft_model(base, cfg, adapter_name=ADAPTER_NAME)
    set_lora_state_dict(peft_model, {k: v.float() for k, v in tensors.items()})
    merged = peft_model.merge_and_unload(safe_merge=True)  # safe_merge: refuse NaN/inf
    if not isinstance(merged, PreTrainedModel):  # the base model, typed as nn.Module by PEFT
        raise TypeError(f"merging gave a {type(merged).__name__}, not a PreTrainedModel")
    # transformers wraps `to` with @wraps(nn.Module.to), so mypy sees the unbound signature
    return merged.to(DTYPES[dtype])  # type: ignore[arg-type]


def export_merged(
    peft_model: PeftModel,
    out_dir: str | Path,
    base_path: str | Path,
    tokenizer: Any,
    dtype: str = "float32",
    *,
    trust_remote_code: bool = False,
) -> Path:
    """Write the merged model (safetensors, config, tokenizer) atomically. Collective: every
    rank calls it (the LoRA tensors are gathered), rank 0 merges and writes."""
    out_dir = Path(out_dir)
    tensors = lora_state_dict(peft_model)
    config = lora_config(peft_model)

    def write() -> None:
        merged = merge_lora(base_path, config, tensors, dtype, trust_remote_code=trust_remote_code)

        def fill(tmp: Path) -> None:
            merged.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)

        write_dir_atomically(out_dir, fill)
        log.info("wrote the merged model (%s) to %s", dtype, out_dir)

    run_on_rank0(write)
    return out_dir


def export_critic(peft_model: PeftModel, out_dir: str | Path) -> Path:
    """Write the critic folder atomically. Collective: every rank gathers, rank 0 writes."""
    out_dir = Path(out_dir)
    tensors = critic_state_dict(peft_model)
    config = critic_config(peft_model)

    run_on_rank0(write_dir_atomically, out_dir, lambda tmp: write_critic_dir(tensors, config, tmp))
    return out_dir


def export_final(peft_model: PeftModel, job: Any, tokenizer: Any, adapter_dir: Path) -> Path:
    """Everything `training.export` asks for; returns the adapter folder (always written)."""
    spec = job.spec
    export_adapter(peft_model, adapter_dir)
    if has_critic(peft_model):
        export_critic(peft_model, adapter_dir.parent / CRITIC_EXPORT_DIR)
    if "merged" in spec.training.export:
        export_merged(
            peft_model,
            adapter_dir.parent / MERGED_DIR,
            spec.model.path,
            tokenizer,
            spec.model.dtype,
            trust_remote_code=spec.model.trust_remote_code,
        )
    return adapter_dir
