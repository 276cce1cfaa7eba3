"""SGLang (0.5.x, pinned 0.5.23) as a rollout engine: the sidecar's HTTP adapter to its server.

Merged pushes use `/update_weights_from_distributed` over a *gloo* group the sidecar hosts (rank 0)
and the engine's TP workers join (`/init_weights_update_group`, ranks 1..tp). Why not the others:
- `/update_weights_from_tensor` ships `MultiprocessingSerializer` (ForkingPickler) handles, not
  data: CUDA-IPC handles need the sidecar inside the engine's GPU context, and CPU tensors travel
  as shared-memory names plus a `torch_shm_manager` / fd-passing socket under the sender's /tmp,
  which another container of the pod cannot reach.
- NCCL refuses two ranks on one GPU, and the sidecar has no GPU of its own.
gloo over loopback needs neither (containers of a pod share the network namespace); the engine
receives into its GPU buffers. One flattened uint8 broadcast per bucket (`load_format:
"flattened_bucket"`), buckets single-dtype so SGLang's receive offsets stay aligned.

SGLang 0.5.23 only accepts weight loads inside a session (`/begin_weight_update` ..
`/end_weight_update`). The version label (`meta_info.weight_version` on every sample) is set by
the last bucket's `weight_version`, together with its `flush_cache`, so it never names weights
that are not fully in. Adapter mode leaves the label alone: requests name a versioned adapter,
and a global label would mislabel samples still running on the previous adapter.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx
import torch
from torch import Tensor

from lorarl.engines import sglang
from lorarl.rollout.engine import EngineError, RolloutEngine, collect_update, validate_merged_update

if TYPE_CHECKING:  # a NewType of str in a private torch module: for the checker only
    from torch.distributed.distributed_c10d import GroupName

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`: SGLang resolves it with `getattr(torch, name)`."""
    return str(dtype).removeprefix("torch.")


def plan_buckets(
    named: Sequence[tuple[str, Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[list[tuple[str, Tensor]]]:
    """Split tensors into single-dtype buckets of at most `bucket_bytes` (a bigger tensor alone).

    Bounded because the engine allocates each bucket as one GPU buffer; single-dtype because
    SGLang refuses a tensor whose byte offset in the bucket is not a multiple of its item size.
    Order within a dtype is kept, so fused siblings stay adjacent.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
    by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    for name, tensor in named:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets: list[list[tuple[str, Tensor]]] = []
    for group in by_dtype.values():
        current: list[tuple[str, Tensor]] = []
        size = 0
        for name, tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def flatten_bucket(bucket: Sequence[tuple[str, Tensor]]) -> Tensor:
    """The bytes SGLang's `FlattenedTensorBucket.empty` + `reconstruct_tensors` expect, in order."""
    return torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for _, t in bucket])


def distributed_update_body(
    bucket: Sequence[tuple[str, Tensor]],
    group_name: str,
    *,
    last: bool,
    version: int,
) -> dict[str, Any]:
    """Body of `POST /update_weights_from_distributed` (`UpdateWeightsFromDistributedReqInput`)."""
    body: dict[str, Any] = {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(t.dtype) for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "flush_cache": last,
        "abort_all_requests": False,
    }
    if last:
        body["weight_version"] = str(version)
    return body


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_update_group(
    host: str,
    port: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout: float,
    rank: int = 0,
) -> Any:
    """One rank (the sidecar: 0, the TCPStore host) of the group SGLang's workers build.

    Built through the same torch helper as SGLang's `init_custom_process_group`, with the same
    store prefix (`group_name`), so the rendezvous keys match; not the default group, which the
    sidecar's trainer sync may own. Sidecar and engine share the rollout image, hence one torch.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    td = timedelta(seconds=timeout)
    store, rank, size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=td))
    store.set_timeout(td)
    pg, _ = _new_process_group_helper(
        size, rank, [], Backend(backend), PrefixStore(group_name, store),
        group_name=cast("GroupName", group_name), backend_options=None, timeout=td,
    )  # fmt: skip
    _world.pg_group_ranks[pg] = {i: i for i in range(size)}
    return pg


class SGLangEngine(RolloutEngine):
    """HTTP adapter to one `sglang.launch_server` (lorarl.engines.sglang.sglang_server_args).

    `group_host` is the address the engine's workers reach the sidecar at (loopback in a pod).
    `tp_size=None` reads it from `/server_info` on the first merged push.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 300.0,
        *,
        tp_size: int | None = None,
        group_host: str = "127.0.0.1",
        group_backend: str = "gloo",
        group_timeout: float = 300.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        flush_timeout: float = 30.0,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self._tp_size = tp_size
        self._group_host, self._group_backend = group_host, group_backend
        self._group_timeout = group_timeout
        self._bucket_bytes = bucket_bytes
        self._flush_timeout = flush_timeout
        self._group: Any = None
        self._group_name: str | None = None
        self._stale_group: str | None = None
        self._engine_was_down = False
        self._version: int | None = None
        self.last_push_seconds: dict[str, float] = {}

    @property
    def weight_version(self) -> int | None:
        return self._version

    @property
    def group_name(self) -> str | None:
        """Name of the live weight-update group (None until the first merged push)."""
        return self._group_name

    def close(self) -> None:
        self.reset_update_group()
        self._http.close()

    # ------------------------------------------------------------------------------- HTTP

    def health(self) -> bool:
        try:
            ok = self._http.get(sglang.HEALTH, timeout=5.0).status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            # It may be restarting, losing its half of the group. Only flag it: a push may be
            # running in another thread (the sidecar polls health meanwhile).
            self._engine_was_down = True
        return ok

    def _request(self, method: str, path: str, what: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise EngineError(f"{what}: {method} {path} failed: {e!r}") from e
        if resp.status_code != 200:
            raise EngineError(f"{what}: {method} {path} -> {resp.status_code}: {resp.text[:500]}")
        return resp

    def _post(self, path: str, what: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST a control request; SGLang answers `{"success": ..., "message": ...}`."""
        resp = self._request("POST", path, what, json=body)
        data = resp.json() if resp.content else {}
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{what}: {path} refused: {data.get('message') or data}")
        return data if isinstance(data, dict) else {}

    def server_info(self) -> dict[str, Any]:
        data = self._request("GET", sglang.SERVER_INFO, "read server info").json()
        if not isinstance(data, dict):
            raise EngineError("read server info: /server_info did not return a JSON object")
        return data

    # ------------------------------------------------------------------------- merged mode

    def _world_tp(self) -> int:
        if self._tp_size is None:
            info = self.server_info()
            tp, dp = info.get("tp_size"), info.get("dp_size", 1)
            if not isinstance(tp, int) or tp < 1:
                raise EngineError(f"read server info: tp_size={tp!r} is not a positive integer")
            if dp != 1:
                raise EngineError(f"SGLang updates weights only with dp_size 1, engine has {dp}")
            self._tp_size = tp
        return self._tp_size

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        if self._stale_group is not None:  # engine still up may hold its half: release it
            with contextlib.suppress(EngineError):
                stale = {"group_name": self._stale_group}
                self._post(sglang.DESTROY_WEIGHTS_UPDATE_GROUP, "destroy stale group", stale)
            self._stale_group = None
        world_size = 1 + self._world_tp()
        name = f"lorarl-{uuid.uuid4().hex[:12]}"
        port = _free_port(self._group_host)
        body: dict[str, Any] = {
            "master_address": self._group_host,
            "master_port": port,
            "rank_offset": 1,
            "world_size": world_size,
            "group_name": name,
            "backend": self._group_backend,
        }
        # Both sides block in the rendezvous until all ranks arrive: POST while we host it.
        answer = _Background(
            lambda: self._post(sglang.INIT_WEIGHTS_UPDATE_GROUP, "init group", body)
        )
        try:
            group = join_update_group(
                self._group_host, port, world_size, name, self._group_backend,
                self._group_timeout,
            )  # fmt: skip
        except Exception as e:
            answer.join(self._group_timeout)
            raise EngineError(f"init group {name!r}: rendezvous on port {port} failed: {e}") from e
        answer.result(self._group_timeout)
        self._group, self._group_name = group, name

    def reset_update_group(self) -> None:
        """Forget the weight-update group (engine restarted, or a push failed mid-way).

        The next merged push builds a new one; the engine's old half is released first.
        """
        if self._group is None:
            return
        group, self._group = self._group, None
        self._stale_group, self._group_name = self._group_name, None
        with contextlib.suppress(Exception):  # a broken group may refuse a clean shutdown
            torch.distributed.destroy_process_group(group)

    def _abandon_group(self) -> None:
        """Forget the group without destroying it: a broadcast may still be blocked in it."""
        if self._group is not None:
            self._group = None
            self._stale_group, self._group_name = self._group_name, None

    def push_merged_weights(
        self, named_tensors: Iterable[tuple[str, Tensor]], version: int
    ) -> None:
        named = collect_update(named_tensors)
        validate_merged_update(named)
        buckets = plan_buckets(list(named.items()), self._bucket_bytes)
        t0 = time.perf_counter()
        if self._engine_was_down:  # a restarted engine has no group: build a new one
            self._engine_was_down = False
            self.reset_update_group()
        self._ensure_group()
        t1 = time.perf_counter()
        self._post(sglang.BEGIN_WEIGHT_UPDATE, "begin weight update", {})
        try:
            for i, bucket in enumerate(buckets):
                self._send_bucket(bucket, last=i == len(buckets) - 1, version=version)
        except BaseException:
            self._abandon_group()  # the engine's half may be mid-receive: never reuse it
            with contextlib.suppress(EngineError):  # close the session; keep the first error
                self._post(sglang.END_WEIGHT_UPDATE, "end weight update", {})
            raise
        self._post(sglang.END_WEIGHT_UPDATE, "end weight update", {})
        self._version = version
        self.last_push_seconds = {"group": t1 - t0, "push": time.perf_counter() - t1}

    def _send_bucket(self, bucket: list[tuple[str, Tensor]], *, last: bool, version: int) -> None:
        assert self._group is not None and self._group_name is not None
        body = distributed_update_body(bucket, self._group_name, last=last, version=version)
        flat = flatten_bucket(bucket)
        what = f"push v{version} ({len(bucket)} tensors, {flat.numel()} bytes)"
        # The engine receives inside the request, so both run at once. If the engine refuses
        # before joining the broadcast, ours would block until the group timeout: answer with
        # the engine's error at once and abandon the broadcast (and the group) instead.
        answer = _Background(lambda: self._post(sglang.UPDATE_WEIGHTS_FROM_DISTRIBUTED, what, body))
        group = self._group
        cast = _Background(lambda: group.broadcast([flat], _root0()).wait())
        deadline = time.monotonic() + self._group_timeout
        while not answer.done and not (cast.done and cast.error is not None):
            if time.monotonic() > deadline:
                raise EngineError(f"{what}: no answer within {self._group_timeout:.0f} s")
            time.sleep(0.005)
        if answer.done and answer.error is not None:
            raise answer.error
        if cast.error is not None:
            raise EngineError(f"{what}: broadcast failed: {cast.error}") from cast.error
        cast.result(self._group_timeout)

    # ------------------------------------------------------------------------ adapter mode

    def load_adapter(self, adapter_dir: str | Path, name: str, version: int) -> None:
        adapter_dir = Path(adapter_dir)
        if not (adapter_dir / "adapter_config.json").is_file():
            raise EngineError(f"adapter_dir {str(adapter_dir)!r} has no adapter_config.json")
        body = {"lora_name": name, "lora_path": str(adapter_dir)}
        what = f"load adapter {name!r} v{version}"
        try:
            self._post_lora(sglang.LOAD_LORA_ADAPTER, what, body)
        except EngineError as e:
            if sglang.LORA_ALREADY_LOADED not in str(e):
                raise
            # SGLang refuses a loaded name; replacing it is unload + load.
            self.unload_adapter(name)
            self._post_lora(sglang.LOAD_LORA_ADAPTER, what, body)
        self._version = version

    def unload_adapter(self, name: str) -> None:
        self._post_lora(sglang.UNLOAD_LORA_ADAPTER, f"unload adapter {name!r}", {"lora_name": name})

    def _post_lora(self, path: str, what: str, body: dict[str, Any]) -> None:
        # LoRA answers are `{"success", "error_message", "loaded_adapters"}` with 400 on failure.
        try:
            resp = self._http.post(path, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"{what}: POST {path} failed: {e!r}") from e
        data = resp.json() if resp.content else {}
        if resp.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            detail = data.get("error_message") if isinstance(data, dict) else None
            raise EngineError(
                f"{what}: POST {path} -> {resp.status_code}: {detail or resp.text[:500]}"
            )

    # ------------------------------------------------------------------------------- cache

    def flush_cache(self) -> None:
        """SGLang refuses (400) while requests run; `timeout` lets it wait for them to drain."""
        self._request(
            "POST", sglang.FLUSH_CACHE, "flush cache", params={"timeout": self._flush_timeout},
            timeout=self._flush_timeout + 30.0,
        )  # fmt: skip


def _root0() -> Any:
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    return opts


class _Background:
    """Run one call in a thread and hand back its result or exception."""

    def __init__(self, fn: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self._result = fn()
        except BaseException as e:
            self._error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def result(self, timeout: float) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise EngineError(f"engine did not answer within {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        return self._result
