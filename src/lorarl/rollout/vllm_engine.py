"""vLLM as a rollout engine: the server command line, and the sidecar's HTTP adapter to it.

Merged mode's default push hands only the adapter to the workers (`push_adapter_merge`: a small
A/B safetensors file, merged in each worker by `lorarl_merge_adapter`, see vllm_worker_ext). The
full-weight push (`push_merged_weights`) goes through a *partial* safetensors folder on /dev/shm
and the worker's `reload_weights` (via `/collective_rpc`). Both end in vLLM's own reload: its RL
weight-transfer backends need an accelerator and, when they fail on CPU, leave layers on the meta
device; writing into parameters directly does not work either, CPU layers are repacked after
loading. See docs/architecture.md#measured-facts.

Side effect to know: vLLM's `reload_weights(weights_path=...)` repoints the engine's
`model_config.model` at that folder, so a later path-less reload would read the (deleted) partial
folder; we always pass a path. LoRA serving on CPU is slow (punica CPU path, measured ~60 ms/token
vs ~5 ms merged on the tiny model), so merged mode is the practical CPU mode.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from torch import Tensor

from lorarl.engines import vllm
from lorarl.engines.vllm import (
    VLLM_RPC_BASE_ENV,
    VLLM_WORKER_EXTENSION,
    inductor_cache_dir,
    vllm_cache_root,
    vllm_rpc_base,
    vllm_server_args,
    vllm_server_env,
)
from lorarl.rollout.engine import EngineError, RolloutEngine, collect_update, validate_merged_update

WORKER_EXTENSION = VLLM_WORKER_EXTENSION
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def vllm_launch_command(
    model_path: str | Path,
    port: int,
    *,
    served_model_name: str,
    run_dir: str | Path,
    dtype: str = "auto",
    host: str = "127.0.0.1",
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    max_loras: int = 1,
    kv_cache_gib: int = 1,
    max_model_len: int | None = None,
    api_key: str | None = None,
    worker_extension_cls: str | None = WORKER_EXTENSION,
    python: str = sys.executable,
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and the environment variables to *add* for one CPU vLLM server outside a job plan.

    The flags and engine env come from `lorarl.engines.vllm`, as the plan's do, so a server
    started here is the one a job runs; this only adds the interpreter and per-run dirs.
    The server always runs its engine core in a child process (V1 multiprocessing off only keeps
    the executor in that process), so stop it by process group. Temp dirs (sockets, Ray) go
    under `run_dir` so runs never share them; vLLM's and Inductor's keyed caches are shared
    (`vllm_cache_root`, `inductor_cache_dir`).
    """
    if not 0 < port < 65536:
        raise ValueError(f"port: {port} is not a TCP port (1-65535)")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {_DTYPES}")
    if kv_cache_gib < 1:
        raise ValueError(f"kv_cache_gib: must be a whole number of GiB >= 1, got {kv_cache_gib}")
    if enable_lora and (max_lora_rank < 1 or max_loras < 1):
        raise ValueError(
            f"max_lora_rank/max_loras: must be >= 1 with LoRA on, got {max_lora_rank}/{max_loras}"
        )
    if not served_model_name:
        raise ValueError("served_model_name: must not be empty (requests name the model)")
    run_dir = Path(run_dir)
    argv = [python, *vllm_server_args(
        str(model_path), host, port,
        served_model_name=served_model_name,
        dtype=dtype,
        max_model_len=max_model_len,
        max_lora_rank=max_lora_rank if enable_lora else None,
        max_loras=max_loras,
        worker_extension_cls=worker_extension_cls,
        extra_args=extra_args,
    )]  # fmt: skip
    env = {
        **vllm_server_env(cpu=True, kv_cache_gib=kv_cache_gib),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(run_dir / "tmp"),
        VLLM_RPC_BASE_ENV: vllm_rpc_base(str(run_dir / "tmp")),
        "VLLM_CACHE_ROOT": vllm_cache_root(os.environ, str(Path.home())),
        "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(os.environ, str(Path.home())),
        "VLLM_CONFIG_ROOT": str(run_dir / "vllm-config"),
        "RAY_TMPDIR": str(run_dir / "ray"),
    }
    if api_key:  # vLLM's own variable: the key stays off the command line
        env[vllm.API_KEY_ENV] = api_key
    return argv, env


def write_partial_checkpoint(named: dict[str, Tensor], directory: Path) -> Path:
    """Write only the changed tensors as a one-file safetensors checkpoint vLLM can reload."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=False)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named.items()}
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def checkpoint_weight_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in a Hugging Face safetensors folder (headers only, no data read)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise EngineError(f"model_dir {str(model_dir)!r} has no *.safetensors files")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a Mapping
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


class VLLMEngine(RolloutEngine):
    """HTTP adapter to one vLLM OpenAI server started with `vllm_launch_command`.

    Pass `known_shapes` (e.g. `checkpoint_weight_shapes(model_dir)`) so a misnamed or misshapen
    tensor is refused here: inside vLLM either kills the engine core.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        shm_dir: str | Path = "/dev/shm/lorarl",
        known_shapes: Mapping[str, Sequence[int]] | None = None,
        timeout: float = 120.0,
        flush_timeout: float = 30.0,
    ) -> None:
        self._known = dict(known_shapes) if known_shapes is not None else None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._shm_dir = Path(shm_dir)
        self._flush_timeout = flush_timeout
        self._version: int | None = None
        self.last_push_seconds: dict[str, float] = {}
        self.last_push_bytes = 0  # bytes the last push wrote for the engine to read
        self.last_worker_report: list[Any] = []

    @property
    def weight_version(self) -> int | None:
        return self._version

    def close(self) -> None:
        self._http.close()

    def health(self) -> bool:
        try:
            return self._http.get(vllm.HEALTH, timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _post(self, path: str, what: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.post(path, **kwargs)
        except httpx.HTTPError as e:
            raise EngineError(f"{what}: POST {path} failed: {e!r}") from e
        if resp.status_code != 200:
            raise EngineError(f"{what}: POST {path} -> {resp.status_code}: {resp.text[:500]}")
        return resp

    def collective_rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """Call `method` on every worker (needs VLLM_SERVER_DEV_MODE=1); one result per worker."""
        resp = self._post(
            vllm.COLLECTIVE_RPC,
            f"collective_rpc {method}",
            json={"method": method, "kwargs": kwargs},
        )
        return resp.json().get("results", []) if resp.content else []

    def push_merged_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], version: int
    ) -> None:
        named = collect_update(named_tensors)
        validate_merged_update(named, self._known)
        t0 = time.perf_counter()
        folder = write_partial_checkpoint(named, self._shm_dir / f"v{version}-{uuid.uuid4().hex}")
        self.last_push_bytes = sum(f.stat().st_size for f in folder.iterdir())
        t1 = time.perf_counter()
        try:
            self.collective_rpc("reload_weights", weights_path=str(folder))
        except EngineError as e:
            raise EngineError(
                f"{e}; a failed reload can leave layers unloaded, restart the engine"
            ) from e
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        t2 = time.perf_counter()
        self.flush_cache()
        self._version = version
        self.last_push_seconds = {
            "write": t1 - t0,
            "reload": t2 - t1,
            "flush": time.perf_counter() - t2,
        }

    def push_adapter_merge(
        self, lora_tensors: Mapping[str, Tensor], scaling: float, base_dir: str | Path, version: int
    ) -> float:
        """Merged mode, merged at the edge: hand only the adapter to the engine's workers.

        The A/B tensors go to a small safetensors file on /dev/shm; each worker merges
        W0 + scaling·B@A from its own pristine copy of `base_dir`'s targeted weights and reloads
        them in process (`lorarl_merge_adapter` in the worker extension). No full-weight tensor
        leaves the engine; `last_push_bytes` is what crossed from the sidecar. Returns the
        slowest worker's merge seconds (the rest of the time is vLLM's reload and the flush).
        """
        from safetensors.torch import save_file

        self._check_adapter_shapes(lora_tensors)
        t0 = time.perf_counter()
        self._shm_dir.mkdir(parents=True, exist_ok=True)
        path = self._shm_dir / f"adapter-v{version}-{uuid.uuid4().hex}.safetensors"
        save_file({n: t.detach().to("cpu").contiguous() for n, t in lora_tensors.items()}, path)
        t1 = time.perf_counter()
        try:
            results = self.collective_rpc(
                "lorarl_merge_adapter",
                adapter_path=str(path),
                scaling=float(scaling),
                base_dir=str(base_dir),
            )
            self.last_push_bytes = path.stat().st_size
        except EngineError as e:
            raise EngineError(
                f"{e}; a failed reload can leave layers unloaded, restart the engine"
            ) from e
        finally:
            path.unlink(missing_ok=True)
        t2 = time.perf_counter()
        self.flush_cache()
        self._version = version
        self.last_push_seconds = {
            "write": t1 - t0,
            "merge_reload": t2 - t1,
            "flush": time.perf_counter() - t2,
        }
        self.last_worker_report = results
        return max(
            (float(r.get("merge_s", 0.0)) for r in results if isinstance(r, dict)), default=0.0
        )

    def _check_adapter_shapes(self, lora_tensors: Mapping[str, Tensor]) -> None:
        """Refuse A/B that do not fit the checkpoint here: a failed reload can kill layers."""
        if self._known is None:
            return  # the worker checks again before it reloads anything
        from lorarl.sync.names import group_lora_pairs

        try:
            pairs = group_lora_pairs(lora_tensors)
        except ValueError as e:
            raise EngineError(f"adapter refused: {e}") from e
        for module, pair in pairs.items():
            shape = self._known.get(f"{module}.weight")
            if shape is None:
                raise EngineError(f"adapter refused: {module!r} is not in the served checkpoint")
            rank = pair.A.shape[0]
            out_f, in_f = shape
            if tuple(pair.A.shape) != (rank, in_f) or tuple(pair.B.shape) != (out_f, rank):
                raise EngineError(
                    f"adapter refused: {module}: A {tuple(pair.A.shape)} / B "
                    f"{tuple(pair.B.shape)} do not fit the base weight {tuple(shape)}"
                )

    def load_adapter(self, adapter_dir: str | Path, name: str, version: int) -> None:
        adapter_dir = Path(adapter_dir)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise EngineError(f"adapter_dir {str(adapter_dir)!r} has no adapter_config.json")
        # load_inplace works whether or not `name` is loaded, so reloads need no bookkeeping.
        body = {"lora_name": name, "lora_path": str(adapter_dir), "load_inplace": True}
        self._post(vllm.LOAD_LORA_ADAPTER, f"load adapter {name!r} v{version}", json=body)
        self.flush_cache()
        self._version = version

    def unload_adapter(self, name: str) -> None:
        self._post(vllm.UNLOAD_LORA_ADAPTER, f"unload adapter {name!r}", json={"lora_name": name})

    def flush_cache(self) -> None:
        """Reset the prefix cache; vLLM refuses while requests hold blocks, so retry a while."""
        deadline = time.monotonic() + self._flush_timeout
        while True:
            resp = self._post(vllm.RESET_PREFIX_CACHE, "flush prefix cache")
            if not resp.content or resp.json().get("success", True):
                return
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"flush prefix cache: engine still refused after {self._flush_timeout:.0f} s "
                    "(requests in flight hold cache blocks)"
                )
            time.sleep(0.1)
