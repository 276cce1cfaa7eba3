"""SGLang's own HTTP server app, run inside `.venv-sglang`, with a recording engine behind it.

`python tests/contract/sglang_harness.py PORT API_KEY MODEL_DIR WORK_DIR` serves SGLang 0.5.x's
real FastAPI `app` (its routes, request parsing, 400-on-bad-body handler, API-key middleware)
under uvicorn. Only
the `TokenizerManager` is replaced: it records every parsed request object, checks sampling
params the way the real one does, keeps SGLang's weight-update session rule, and receives merged
weights through SGLang's own `WeightUpdater` code on CPU/gloo. Contract routes under `/_contract/`
let the main-venv tests ask SGLang's `ServerArgs` parser and request types directly.

This file runs only in the SGLang env: lorarl is not importable here, on purpose.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import sys
import time
import types
import typing
from io import StringIO
from pathlib import Path
from typing import Any

# The torchvision stand-in must win over any real one, before SGLang is imported.
sys.path.insert(0, str(Path(__file__).resolve().parent / "sglang_stubs"))
os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

import msgspec
import pydantic
import torch
import torch.distributed as dist
import uvicorn
from fastapi import Request
from sglang.api.v1.api_types import SamplingParams as ApiSamplingParams
from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
from sglang.srt.entrypoints import http_server as hs
from sglang.srt.entrypoints.api_contract import generate_contract_error
from sglang.srt.managers import io_struct as io
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.model_executor.model_runner_components.weight_updater import (
    WeightUpdater,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.auth import add_api_key_middleware

VOCAB_SIZE = 32000
DEFAULT_REPLY = {"output_ids": [5], "finish_reason": {"type": "length", "length": 1}}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        if isinstance(value, (list, tuple)):
            return [_jsonable(v) for v in value]
        if isinstance(value, dict):
            return {str(k): _jsonable(v) for k, v in value.items()}
        return repr(value)


def _to_builtins(obj: Any) -> dict[str, Any]:
    if isinstance(obj, msgspec.Struct):
        names = [f.name for f in msgspec.structs.fields(type(obj))]
    else:
        names = [f.name for f in dataclasses.fields(obj)]
    return {n: _jsonable(getattr(obj, n)) for n in names}


class _ByteTokenizer:
    """What `SamplingParams.normalize` asks of the tokenizer (stop-string lengths in tokens): the
    real manager passes the model's; None would mean --skip-tokenizer-init, which we never set."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


class FakeTokenizerManager:
    """Stands in for SGLang's TokenizerManager: records, validates, receives weights."""

    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.startup_time = time.time()
        self.gracefully_exit = False
        self.server_status = hs.ServerStatus.Up
        self.is_generation = True
        self.calls: list[dict[str, Any]] = []
        self.loras: dict[str, str] = {}
        self.session_open = False
        self.weight_version = "default"
        self.reply = dict(DEFAULT_REPLY)  # what /generate answers; `/_contract/reply` sets it
        self.offload_tags: set[str] = set()  # memory released and not yet resumed
        self.updater = types.SimpleNamespace(tp_rank=0, device="cpu", _model_update_group={})
        self.updater._receive_bucketed_weights_from_distributed = functools.partial(
            WeightUpdater._receive_bucketed_weights_from_distributed, self.updater
        )

    def _record(self, route: str, obj: Any, **extra: Any) -> None:
        self.calls.append({"route": route, "type": type(obj).__name__, "obj": _to_builtins(obj),
                           **extra})  # fmt: skip

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{}]

    async def generate_request(self, obj: GenerateReqInput, request: Request | None = None):
        parsed = _to_builtins(obj)  # as the route parsed it, before n fans out into a batch
        obj.normalize_batch_and_arguments()  # what the real manager does first
        params = (
            obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params]
        )
        for p in params:  # the real manager's per-request checks (bad values -> ValueError)
            sp = SamplingParams(**(p or {}))
            sp.normalize(_ByteTokenizer())
            sp.verify(VOCAB_SIZE)
        self.calls.append({"route": "/generate", "type": type(obj).__name__, "obj": parsed,
                           "parallel_sample_num": obj.parallel_sample_num})  # fmt: skip
        n = (params[0] or {}).get("n", 1)
        ids = list(self.reply["output_ids"])
        out = {
            "text": "",
            "output_ids": ids,
            "meta_info": {
                "finish_reason": self.reply["finish_reason"],
                "output_token_logprobs": [[-0.5, t, None] for t in ids],
                "weight_version": self.weight_version,
            },
        }
        yield [out] * n if n > 1 else out

    async def flush_cache(self, timeout_s: float | None = None) -> io.FlushCacheReqOutput:
        self.calls.append({"route": "/flush_cache", "type": None, "obj": {"timeout_s": timeout_s}})
        return io.FlushCacheReqOutput(success=True)

    async def init_weights_update_group(self, obj, request=None) -> tuple[bool, str]:
        self._record("/init_weights_update_group", obj)
        return await asyncio.to_thread(
            WeightUpdater.init_weights_update_group, self.updater, obj.master_address,
            obj.master_port, obj.rank_offset, obj.world_size, obj.group_name, obj.backend,
        )  # fmt: skip

    async def destroy_weights_update_group(self, obj, request=None) -> tuple[bool, str]:
        self._record("/destroy_weights_update_group", obj)
        return WeightUpdater.destroy_weights_update_group(self.updater, obj.group_name)

    async def begin_weight_update(self, obj, request=None) -> tuple[bool, str]:
        self._record("/begin_weight_update", obj)
        if self.session_open:
            return False, "a weight-update session is already open"
        self.session_open = True
        return True, "Success"

    async def end_weight_update(self, obj, request=None) -> tuple[bool, str]:
        self._record("/end_weight_update", obj)
        if not self.session_open:
            return False, "no weight-update session is open"
        self.session_open = False
        return True, "Success"

    async def update_weights_from_distributed(self, obj, request=None) -> tuple[bool, str]:
        if not self.session_open:
            self._record("/update_weights_from_distributed", obj)
            return False, "must run between begin_weight_update() and end_weight_update()"
        try:
            weights = await asyncio.to_thread(
                WeightUpdater.receive_weights_from_distributed, self.updater, names=obj.names,
                dtypes=obj.dtypes, shapes=obj.shapes, group_name=obj.group_name,
                load_format=obj.load_format,
            )  # fmt: skip
        except Exception as e:
            self._record("/update_weights_from_distributed", obj)
            return False, f"Failed to receive weights: {e}"
        received = {
            name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                   "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()}
            for name, t in weights
        }  # fmt: skip
        self._record("/update_weights_from_distributed", obj, received=received)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return True, "Succeeded to update parameter online."

    async def update_weight_version(self, obj) -> None:
        self._record("/update_weight_version", obj)
        self.weight_version = obj.new_version

    async def release_memory_occupation(self, obj, request=None) -> None:
        """The scheduler's tag bookkeeping (scheduler_components/weight_updater.py): no tags
        means every memory type; resuming a tag never released raises (the route: 400)."""
        self._record("/release_memory_occupation", obj)
        self.offload_tags.update(obj.tags or GPU_MEMORY_ALL_TYPES)

    async def resume_memory_occupation(self, obj, request=None) -> None:
        self._record("/resume_memory_occupation", obj)
        for tag in obj.tags or GPU_MEMORY_ALL_TYPES:
            self.offload_tags.remove(tag)

    async def load_lora_adapter(self, obj, request=None) -> io.LoadLoRAAdapterReqOutput:
        self._record("/load_lora_adapter", obj)
        if obj.lora_name in self.loras:  # LoRAManager's refusal text in 0.5.23
            return io.LoadLoRAAdapterReqOutput(
                success=False,
                error_message=f"Failed to load LoRA adapter {obj.lora_name} because it is "
                "already loaded",
            )
        self.loras[obj.lora_name] = obj.lora_path
        return io.LoadLoRAAdapterReqOutput(success=True, loaded_adapters=dict(self.loras))

    async def unload_lora_adapter(self, obj, request=None) -> io.UnloadLoRAAdapterReqOutput:
        self._record("/unload_lora_adapter", obj)
        if self.loras.pop(obj.lora_name, None) is None:
            return io.UnloadLoRAAdapterReqOutput(
                success=False, error_message=f"LoRA adapter {obj.lora_name} is not loaded"
            )
        return io.UnloadLoRAAdapterReqOutput(success=True, loaded_adapters=dict(self.loras))


# ----------------------------------------------------------------------- contract helpers


def parse_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))


def _body_type(path: str, method: str) -> Any:
    """The request type SGLang's route for `path` parses its JSON body into (None: no body)."""
    for route in hs.app.routes:
        if getattr(route, "path", None) == path and method in getattr(route, "methods", ()):
            hints = typing.get_type_hints(route.endpoint, include_extras=True)
            for name in inspect.signature(route.endpoint).parameters:
                hint = hints.get(name)
                if typing.get_origin(hint) is typing.Annotated:
                    hint = typing.get_args(hint)[0]
                if typing.get_origin(hint) is typing.Union:  # Optional[X]
                    hint = next(a for a in typing.get_args(hint) if a is not type(None))
                if isinstance(hint, type) and (
                    dataclasses.is_dataclass(hint) or issubclass(hint, msgspec.Struct)
                ):
                    return hint
            return None
    raise KeyError(f"SGLang has no {method} route {path!r}")


def _fields(tp: Any) -> tuple[set[str], set[str]]:
    """(all field names, required field names) of a request dataclass or msgspec Struct."""
    if dataclasses.is_dataclass(tp):
        fs = dataclasses.fields(tp)
        required = {
            f.name for f in fs
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }  # fmt: skip
        return {f.name for f in fs}, required
    fs = msgspec.structs.fields(tp)
    required = {f.name for f in fs if f.required}
    return {f.name for f in fs}, required


def check_body(path: str, method: str, body: Any) -> dict[str, Any]:
    """Static contract check of one body against the route's own request type."""
    tp = _body_type(path, method)
    if tp is None:
        return {"type": None, "unknown": sorted(body or {}), "missing": [], "errors": []}
    names, required = _fields(tp)
    result: dict[str, Any] = {
        "type": tp.__name__,
        "unknown": sorted(set(body) - names),
        "missing": sorted(required - set(body)),
        "errors": [],
    }
    try:  # the same pydantic schema FastAPI builds for the route
        pydantic.TypeAdapter(tp).validate_python(body)
    except pydantic.ValidationError as e:
        result["errors"].append(str(e))
    if tp is GenerateReqInput:
        error = generate_contract_error(body)
        if error:
            result["errors"].append(error)
        sp = body.get("sampling_params")
        if isinstance(sp, dict):  # the public schema's field set (the srt struct has internals)
            known = _fields(ApiSamplingParams)[0]
            result["unknown"] += [f"sampling_params.{k}" for k in sorted(set(sp) - known)]
    return result


def install_contract_routes(tm: FakeTokenizerManager) -> None:
    @hs.app.post("/_contract/server_args")
    async def server_args_route(request: Request):
        req = await request.json()
        err = StringIO()
        try:
            with contextlib.redirect_stderr(err):
                sa = parse_server_args(req["argv"])
        except (SystemExit, argparse.ArgumentError, ValueError) as e:
            return {"error": f"{e} {err.getvalue()}".strip()}
        if req.get("resolve"):  # the values a server would run with (its resolution hooks)
            try:
                sa.resolve_once()
            except Exception as e:
                return {"error": f"resolution failed: {type(e).__name__}: {e}"}
            resolved = sa.resolved_dict()
            return {"fields": {k: _jsonable(resolved[k]) for k in req["fields"]}}
        return {"fields": {k: _jsonable(getattr(sa, k)) for k in req["fields"]}}

    @hs.app.post("/_contract/check")
    async def check_route(request: Request):
        req = await request.json()
        return check_body(req["path"], req.get("method", "POST"), req["body"])

    @hs.app.post("/_contract/reply")
    async def reply_route(request: Request):
        tm.reply = await request.json() or dict(DEFAULT_REPLY)  # {}: back to the default
        return {"reply": tm.reply}

    @hs.app.get("/_contract/calls")
    async def calls_route():
        return {
            "calls": tm.calls,
            "weight_version": tm.weight_version,
            "offload_tags": sorted(tm.offload_tags),
            "all_memory_types": GPU_MEMORY_ALL_TYPES,
        }


def recording(app: Any, raw: list[dict[str, Any]]) -> Any:
    """ASGI wrapper keeping every raw request (method, path, query, JSON body) as sent."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http" or scope["path"].startswith("/_contract/"):
            return await app(scope, receive, send)
        chunks: list[bytes] = []

        async def tee():
            message = await receive()
            chunks.append(message.get("body", b""))
            return message

        async def finish(message):
            if message["type"] == "http.response.start":
                try:
                    body = json.loads(b"".join(chunks)) if b"".join(chunks) else None
                except ValueError:
                    body = "<not json>"
                raw.append({"method": scope["method"], "path": scope["path"],
                            "query": scope["query_string"].decode(), "body": body,
                            "status": message["status"]})  # fmt: skip
            await send(message)

        await app(scope, tee, finish)

    return wrapped


def main() -> None:
    port, api_key, model_dir, work = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    # SGLang's group init asserts that the engine's own default group exists.
    dist.init_process_group("gloo", init_method=f"file://{work}/default-group", rank=0,
                            world_size=1)  # fmt: skip
    server_args = parse_server_args(["--model-path", model_dir, "--device", "cpu",
                                     "--api-key", api_key])  # fmt: skip
    server_args.resolve_once()  # /server_info reports the resolved values
    tm = FakeTokenizerManager(server_args)
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None,
                                        scheduler_info={}))  # fmt: skip
    add_api_key_middleware(hs.app, api_key=api_key, admin_api_key=None)
    install_contract_routes(tm)
    raw: list[dict[str, Any]] = []

    @hs.app.get("/_contract/raw")
    async def raw_route():
        return {"requests": raw}

    uvicorn.run(recording(hs.app, raw), host="127.0.0.1", port=port, lifespan="off",
                log_level="warning")  # fmt: skip


if __name__ == "__main__":
    main()
