"""PEFT adapter folders: what checkpoints export and what the sidecar hands an engine in adapter
mode (adapter_model.safetensors + adapter_config.json, exactly as `save_pretrained` writes)."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:  # peft (and transformers under it) costs ~4.7 s per process start
    from peft import LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def write_adapter_dir(tensors: dict[str, torch.Tensor], config: LoraConfig, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(config)
    cfg.inference_mode = True
    for key in ("target_modules", "exclude_modules"):  # sets: sort so files are reproducible
        value = getattr(cfg, key, None)
        if isinstance(value, (set, frozenset)):
            setattr(cfg, key, sorted(value))
    cfg.save_pretrained(str(out_dir))
    plain = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_file(plain, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def adapter_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names and exact bytes: equal fingerprints mean bit-identical adapters."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(name.encode())
        digest.update(str(t.dtype).encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()[:16]
