"""vLLM worker extension: read back the exact weights a running engine computes with.

On CPU vLLM repacks linear weights for oneDNN/sgl kernels after loading and leaves `.weight`
empty, so checksums of parameters prove nothing. Feeding an identity matrix through the layer's
own GEMM returns `I @ W.T`, i.e. W exactly (one non-zero term per output element), as served.

Enable with `--worker-extension-cls lorarl.rollout.vllm_worker_ext.LoraRLWorkerExtension` and call
over HTTP: `POST /collective_rpc {"method": "lorarl_read_weights",
"kwargs": {"names": [...], "out_path": "/dev/shm/x.safetensors"}}` (needs VLLM_SERVER_DEV_MODE=1).
Method names carry a `lorarl_` prefix because vLLM refuses extensions that shadow worker attributes.

`lorarl_merge_adapter` is merged sync at the edge: the sidecar hands over only the adapter and
each worker merges it into the weights it serves, from its own pristine copy of the base.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lorarl.sync.merge import BaseWeights, merge_adapter, weight_files
from lorarl.sync.names import group_lora_pairs, modules_to_send


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
        sizes = module.output_partition_sizes  # a plain attribute: the fused members' rows
        assert isinstance(sizes, (list, tuple))
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


def _adapter_file(adapter_path: str) -> Path:
    """A PEFT adapter folder's `adapter_model.safetensors`, or a bare A/B safetensors file."""
    path = Path(adapter_path)
    return path / "adapter_model.safetensors" if path.is_dir() else path


class PristineBase:
    """Host copies of the targeted base weights, read once from the served checkpoint.

    Only the names a sync touches are read (safetensors, one shard at a time); they are never
    written, so every version merges from the same W0 and nothing accumulates.
    """

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self.files = weight_files(Path(model_dir))
        self.tensors: dict[str, torch.Tensor] = {}

    def modules(self) -> set[str]:
        return {n.removesuffix(".weight") for n in self.files if n.endswith(".weight")}

    def ensure(self, modules: list[str]) -> None:
        missing = [m for m in modules if f"{m}.weight" not in self.tensors]
        if missing:
            self.tensors.update(BaseWeights.from_safetensors(self.model_dir, missing))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def edge_merged_weights(
    pristine: PristineBase,
    adapter_path: str,
    scaling: float,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
    """(names, lazy iterator of full HF-named merged weights W0 + s·B@A, fused siblings too).

    Lazy so one module's W0 copy, delta and result exist at a time, on `device` (the worker's).
    """
    pairs = group_lora_pairs(load_file(str(_adapter_file(adapter_path))))
    if not pairs:
        raise ValueError(f"{adapter_path}: no lora_A/lora_B tensors")
    send = modules_to_send(list(pairs), known_modules=pristine.modules())
    pristine.ensure(send)
    for module, pair in pairs.items():  # refuse before reloading: a failed reload kills layers
        out_f, in_f = pristine.tensors[f"{module}.weight"].shape
        rank = pair.A.shape[0]
        if tuple(pair.A.shape) != (rank, in_f) or tuple(pair.B.shape) != (out_f, rank):
            raise ValueError(
                f"{module}: A {tuple(pair.A.shape)} / B {tuple(pair.B.shape)} do not fit the "
                f"base weight ({out_f}, {in_f})"
            )
    passthrough = [f"{m}.weight" for m in send if m not in pairs]
    names = [f"{m}.weight" for m in pairs] + passthrough
    merged = merge_adapter(pristine.tensors, pairs, scaling, dtype, device, passthrough)
    return names, merged


class LoraRLWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def lorarl_read_weights(self, names: list[str] | str, out_path: str) -> dict[str, list[int]]:
        """Write the served weights for `names` to a safetensors file; returns name -> shape.

        Under tensor parallelism each worker holds (and writes) its own shard: put `{rank}` in
        `out_path` so the workers do not overwrite each other's file.
        """
        if isinstance(names, str):
            names = [names]
        out_path = out_path.replace("{rank}", str(getattr(self, "rank", 0)))
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tensors = {name: read_linear_weight(*resolve_weight(model, name)) for name in names}
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, out_path)
        return {name: list(t.shape) for name, t in tensors.items()}

    def lorarl_merge_adapter(
        self, adapter_path: str, scaling: float, base_dir: str
    ) -> dict[str, float | int]:
        """Merge a LoRA adapter into the weights this worker serves: W = W0 + scaling·B@A.

        Only the adapter crosses the process boundary (a PEFT adapter folder or a safetensors of
        its A/B tensors); W0 is this worker's pristine host copy of the targeted weights from the
        checkpoint in `base_dir`, read on first use. The full HF-named merged tensors go through
        the worker's own `reload_weights(weights_iterator=...)`, in process: vLLM's weight loaders
        stack q/k/v and gate/up, take this worker's tensor-parallel shard (column-parallel rows,
        row-parallel columns) and its layerwise reload re-runs `process_weights_after_loading`
        (the CPU kernels' repacking), exactly as at start-up and as the file-based reload does.
        """
        t0 = time.perf_counter()
        pristine: PristineBase | None = getattr(self, "_lorarl_pristine", None)
        if pristine is None or pristine.model_dir != base_dir:
            pristine = PristineBase(base_dir)
            self._lorarl_pristine = pristine
        dtype = self.model_config.dtype  # type: ignore[attr-defined]  # vLLM's Worker attribute
        device = getattr(self, "device", None)  # set by the worker's init_device
        names, weights = edge_merged_weights(pristine, adapter_path, scaling, dtype, device)
        merge_s = [0.0]

        def timed() -> Iterator[tuple[str, torch.Tensor]]:
            """The merge runs lazily inside the reload (one weight at a time): time it apart."""
            while True:
                start = time.perf_counter()
                item = next(weights, None)
                merge_s[0] += time.perf_counter() - start
                if item is None:
                    return
                yield item

        t1 = time.perf_counter()
        self.reload_weights(  # type: ignore[attr-defined]  # vLLM's Worker method
            weights_iterator=timed(), is_checkpoint_format=True
        )
        total = time.perf_counter() - t1
        return {
            "weights": len(names),
            "pristine_bytes": pristine.nbytes,
            "prepare_s": t1 - t0,
            "merge_s": merge_s[0],
            "reload_s": total - merge_s[0],
        }
