"""vLLM worker extension: read back the exact weights a running engine computes with.

On CPU vLLM repacks linear weights for oneDNN/sgl kernels after loading and leaves `.weight`
empty, so checksums of parameters prove nothing. Feeding an identity matrix through the layer's
own GEMM returns `I @ W.T`, i.e. W exactly (one non-zero term per output element), as served.

Enable with `--worker-extension-cls lorarl.rollout.vllm_worker_ext.LoraRLWorkerExtension` and call
over HTTP: `POST /collective_rpc {"method": "lorarl_read_weights",
"kwargs": {"names": [...], "out_path": "/dev/shm/x.safetensors"}}` (needs VLLM_SERVER_DEV_MODE=1).
Method names carry a `lorarl_` prefix because vLLM refuses extensions that shadow worker attributes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def _base(module: nn.Module) -> nn.Module:
    """vLLM's LoRA wrappers hold the real layer in `base_layer`; read that, not base + delta."""
    return getattr(module, "base_layer", module)


def resolve_weight(model: nn.Module, hf_name: str) -> tuple[nn.Module, slice]:
    """HF weight name -> (vLLM linear layer, slice of its output rows that holds that weight)."""
    module_path, _, param = hf_name.rpartition(".")
    if param != "weight" or not module_path:
        raise ValueError(f"{hf_name!r}: only '<module>.weight' names of linear layers can be read")
    try:
        return _base(model.get_submodule(module_path)), slice(None)
    except AttributeError:
        pass
    parent, _, leaf = module_path.rpartition(".")
    for fused, members in getattr(model, "packed_modules_mapping", {}).items():
        if leaf not in members:
            continue
        module = _base(model.get_submodule(f"{parent}.{fused}" if parent else fused))
        sizes = list(module.output_partition_sizes)
        idx = members.index(leaf)
        start = sum(sizes[:idx])
        return module, slice(start, start + sizes[idx])
    raise ValueError(f"{hf_name!r}: no such module in the served model (nor a fused member)")


@torch.inference_mode()
def read_linear_weight(module: nn.Module, rows: slice) -> torch.Tensor:
    """Recover W (out, in) as the layer's kernel applies it, without its bias."""
    method = getattr(module, "quant_method", None)
    in_features = getattr(module, "input_size_per_partition", None)
    if method is None or in_features is None:
        raise ValueError(f"{type(module).__name__} is not a vLLM linear layer")
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    eye = torch.eye(in_features, dtype=dtype)
    out = method.apply(module, eye, None)  # I @ W.T == W.T
    return out.t()[rows].contiguous()


class LoraRLWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def lorarl_read_weights(self, names: list[str] | str, out_path: str) -> dict[str, list[int]]:
        """Write the served weights for `names` to a safetensors file; returns name -> shape."""
        if isinstance(names, str):
            names = [names]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tensors = {name: read_linear_weight(*resolve_weight(model, name)) for name in names}
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out_path)
        return {name: list(t.shape) for name, t in tensors.items()}
