"""vLLM's weight-update routes for the test engine: `/collective_rpc` `reload_weights` with a
partial safetensors folder or `lorarl_merge_adapter` with an A/B file, `/v1/load_lora_adapter`
(with `load_inplace`), `/v1/unload_lora_adapter` and `/reset_prefix_cache` — the calls
`VLLMEngine` makes, so the real sidecar can drive this server in fast tests. The real vLLM is
exercised by the slow tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file

from lorarl.sync.merge import merge_weight
from lorarl.sync.names import group_lora_pairs


def _merged_from_adapter(
    pristine: dict[str, torch.Tensor], folder: Path
) -> dict[str, torch.Tensor]:
    config = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    merged = {}
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        key = f"{module}.weight"
        merged[key] = (pristine[key].float() + scaling * (b.float() @ a.float())).to(
            pristine[key].dtype
        )
    return merged


def add_weight_update_routes(app: FastAPI, engine: Any, known_models: set[str]) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> JSONResponse:
        body = await request.json()
        if body.get("method") == "lorarl_merge_adapter":  # the worker extension's edge merge
            kwargs = body["kwargs"]
            pairs = group_lora_pairs(load_file(kwargs["adapter_path"]))
            try:
                scaling = float(kwargs["scaling"])
                merged = {
                    f"{m}.weight": merge_weight(engine.pristine[f"{m}.weight"], p.A, p.B, scaling)
                    for m, p in pairs.items()
                }
                engine.reload_weights(merged)
            except (KeyError, ValueError) as exc:
                return JSONResponse({"error": str(exc)}, 500)
            return JSONResponse({"results": [{"weights": len(merged), "merge_s": 0.0}]})
        if body.get("method") != "reload_weights":
            return JSONResponse({"error": f"unsupported method {body.get('method')}"}, 400)
        folder = Path(body["kwargs"]["weights_path"])
        named: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            named.update(load_file(str(f)))
        try:
            engine.reload_weights(named)
        except KeyError as exc:
            return JSONResponse({"error": str(exc)}, 500)
        return JSONResponse({"results": [None]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return JSONResponse({})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await request.json()
        name, path = body["lora_name"], Path(body["lora_path"])
        if name in known_models and not body.get("load_inplace"):
            return JSONResponse({"error": f"adapter {name} already loaded"}, 400)
        engine.add_adapter(name, _merged_from_adapter(engine.pristine, path))
        known_models.add(name)
        return JSONResponse({})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        name = (await request.json())["lora_name"]
        if name not in known_models:
            return JSONResponse({"error": f"adapter {name} not found"}, 404)
        engine.remove_adapter(name)
        known_models.discard(name)
        return JSONResponse({})
