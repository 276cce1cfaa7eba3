"""A tiny rollout engine for tests: a transformers model behind vLLM's and SGLang's HTTP formats.

Stands in for a real vLLM/SGLang server where none can run (tests only). It samples for real and
reports real logprobs of the sampled tokens, so client tests can check them against a forward
pass. Logprob conventions follow the engines as lorarl starts them: both report the
temperature-scaled distribution (vLLM with `--logprobs-mode processed_logprobs`; pass
`logprobs_mode="raw_logprobs"` for vLLM's own default), SGLang by its default.
`app.state.controls` lets a test count requests, inject 503s, delay answers or change the
reported weight version.

Run in process with `serve_in_thread(create_app(model_dir))`, or as a subprocess:
`python -m harness.engines.hf_engine_server --model DIR --port 8000`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.engines.hf_engine_updates import add_weight_update_routes
from lorarl.server.serve import serve_in_thread

__all__ = ["create_app", "serve_in_thread"]


@dataclass
class Controls:
    """Knobs and counters a test reads or sets while the server runs."""

    requests: Counter[str] = field(default_factory=Counter)  # per path, incl. rejected ones
    fail_next: int = 0  # answer this many generation requests with 503
    delay_s: float = 0.0  # sleep before answering a generation request
    weight_version: str = "default"  # SGLang's meta_info.weight_version
    auth_headers: list[str | None] = field(default_factory=list)


@dataclass
class Completion:
    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token: top alternatives (raw distribution)
    finish: Literal["stop", "length"]
    stop_token: int | None  # the stop_token_ids entry that ended it (vLLM's stop_reason)


class HFEngine:
    """Batched sampling of n continuations with a KV cache; one request at a time."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_len = int(self.model.config.max_position_embeddings)
        self.vocab_size = int(self.model.config.vocab_size)
        self._lock = threading.Lock()
        # Weight updates as vLLM applies them: merged pushes replace base weights in place;
        # adapters are served under their own name on top of the pristine base.
        self.pristine = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.overrides: dict[str, dict[str, torch.Tensor]] = {}
        self.active: str | None = None
        self.base_name: str | None = None

    def reload_weights(self, named: dict[str, torch.Tensor]) -> None:
        unknown = sorted(set(named) - set(self.pristine))
        if unknown:
            raise KeyError(f"unknown weight names {unknown[:3]}")
        with self._lock:
            self.overrides.setdefault(self.base_name, {}).update(named)
            self.active = None  # re-activate on the next request

    def add_adapter(self, name: str, named: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self.overrides[name] = named
            self.active = None

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self.overrides.pop(name, None)
            self.active = None

    def _activate(self, name: str | None) -> None:
        if name == self.active:
            return
        state = dict(self.pristine)
        if name != self.base_name:  # adapters sit on the pristine base, like vLLM's LoRA
            state.update(self.overrides.get(self.base_name, {}) if name is None else {})
        state.update(self.overrides.get(name, {}))
        self.model.load_state_dict(state)
        self.active = name

    @torch.no_grad()
    def prompt_logprobs(self, prompt: list[int], model_name: str | None = None) -> list[float]:
        """log p(prompt[t] | prompt[<t]) for t >= 1, raw (no temperature): vLLM's
        `prompt_logprobs`, SGLang's `input_token_logprobs`."""
        with self._lock:
            self._activate(model_name or self.base_name)
            logits = self.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        return [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]

    @torch.no_grad()
    def sample(
        self,
        prompt: list[int],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        stop_ids: list[int],
        scaled_logprobs: bool,
        n_top: int,
        model_name: str | None = None,
    ) -> list[Completion]:
        gen = torch.Generator().manual_seed(
            seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little")
        )
        with self._lock:
            self._activate(model_name or self.base_name)
            out = self.model(input_ids=torch.tensor([prompt] * n), use_cache=True)
            rows: list[Completion] = [Completion([], [], [], "length", None) for _ in range(n)]
            done = [False] * n
            for _ in range(max_tokens):
                logits = out.logits[:, -1, :].float()
                raw = torch.log_softmax(logits, dim=-1)
                chosen = _choose(logits, temperature, top_p, top_k, gen)
                reported = (
                    torch.log_softmax(logits / temperature, dim=-1)
                    if scaled_logprobs and temperature > 0
                    else raw
                )
                top_v, top_i = raw.topk(n_top, dim=-1) if n_top else (None, None)
                for r in range(n):
                    if done[r]:
                        continue
                    tok = int(chosen[r])
                    rows[r].ids.append(tok)
                    rows[r].logprobs.append(float(reported[r, tok]))
                    if top_i is not None:
                        rows[r].top.append(
                            [(int(i), float(v)) for i, v in zip(top_i[r], top_v[r], strict=True)]
                        )
                    if tok in self.eos_ids or tok in stop_ids:
                        done[r] = True
                        rows[r].finish = "stop"
                        rows[r].stop_token = tok if tok in stop_ids else None
                if all(done):
                    break
                out = self.model(
                    input_ids=chosen[:, None], past_key_values=out.past_key_values, use_cache=True
                )
        return rows


def _choose(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, gen: torch.Generator
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p > top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


# --------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class VllmCompletionRequest(_Strict):
    model: str | None = None
    prompt: list[int] | list[list[int]]
    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    stream: bool = False


class SglangSamplingParams(_Strict):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    n: int = Field(1, ge=1)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    sampling_seed: int | None = None


class SglangGenerateRequest(_Strict):
    input_ids: list[int] | list[list[int]]
    sampling_params: SglangSamplingParams = Field(default_factory=SglangSamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None = None
    rid: str | None = None


# --------------------------------------------------------------------------------------- app


def create_app(
    model_dir: str | Path,
    *,
    served_model_name: str = "tiny",
    lora_names: tuple[str, ...] = (),
    api_key: str | None = None,
    logprobs_mode: str = "processed_logprobs",
) -> FastAPI:
    """vLLM `/v1/completions` + SGLang `/generate` + `/health` over one HF model."""
    engine = HFEngine(model_dir)
    engine.base_name = served_model_name
    controls = Controls()
    app = FastAPI()
    app.state.engine = engine
    app.state.controls = controls
    known_models = {served_model_name, *lora_names}

    async def gate(request: Request) -> JSONResponse | None:
        controls.requests[request.url.path] += 1
        auth = request.headers.get("authorization")
        controls.auth_headers.append(auth)
        if api_key is not None and auth != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        if controls.fail_next > 0:
            controls.fail_next -= 1
            return _error("injected failure", 503)
        if controls.delay_s:
            await asyncio.sleep(controls.delay_s)
        return None

    @app.get("/health")
    async def health() -> dict[str, str]:
        controls.requests["/health"] += 1
        return {}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        if (rejected := await gate(request)) is not None:
            return rejected
        try:
            req = VllmCompletionRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return _error(str(exc), 400)
        name = req.model or served_model_name
        if name not in known_models:
            return _error(f"The model `{name}` does not exist.", 404, "NotFoundError")
        prompts = req.prompt if req.prompt and isinstance(req.prompt[0], list) else [req.prompt]
        if problem := _check_lengths(engine, prompts, req.max_tokens):  # type: ignore[arg-type]
            return _error(problem, 400)
        choices = []
        for prompt in prompts:
            rows = await anyio.to_thread.run_sync(
                lambda p=prompt: engine.sample(
                    p,
                    req.n,
                    req.max_tokens,
                    req.temperature,
                    req.top_p,
                    req.top_k or -1,
                    req.seed,
                    req.stop_token_ids,
                    logprobs_mode == "processed_logprobs",
                    req.logprobs or 0,
                    name,
                )
            )
            prompt_lps = None
            if req.prompt_logprobs is not None:  # vLLM: None, then {token id: Logprob} per token
                values = await anyio.to_thread.run_sync(
                    lambda p=prompt: engine.prompt_logprobs(p, name)
                )
                prompt_lps = [None] + [
                    {str(t): {"logprob": lp, "rank": None, "decoded_token": None}}
                    for t, lp in zip(prompt[1:], values, strict=True)
                ]
            for row in rows:
                choice = _vllm_choice(engine, row, len(choices), req)
                choice["prompt_logprobs"] = prompt_lps
                choices.append(choice)
        completion_tokens = sum(len(c["_ids"]) for c in choices)
        prompt_tokens = sum(len(p) for p in prompts)  # type: ignore[arg-type]
        for c in choices:
            del c["_ids"]
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    add_weight_update_routes(app, engine, known_models)

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        if (rejected := await gate(request)) is not None:
            return rejected
        try:
            req = SglangGenerateRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return _error(str(exc), 400)
        if req.stream:
            return _error("streaming is not supported by the test engine", 400)
        if req.lora_path is not None and req.lora_path not in lora_names:
            return _error(f"LoRA adapter {req.lora_path!r} is not loaded", 400)
        sp = req.sampling_params
        single = not (req.input_ids and isinstance(req.input_ids[0], list))
        prompts = [req.input_ids] if single else req.input_ids
        if problem := _check_lengths(engine, prompts, sp.max_new_tokens):  # type: ignore[arg-type]
            return _error(problem, 400)
        outputs = []
        for prompt in prompts:
            rows = await anyio.to_thread.run_sync(
                lambda p=prompt: engine.sample(
                    p,
                    sp.n,
                    sp.max_new_tokens,
                    sp.temperature,
                    sp.top_p,
                    sp.top_k,
                    sp.sampling_seed,
                    sp.stop_token_ids or [],
                    True,
                    0,
                )
            )
            start = req.logprob_start_len
            inputs = None
            if req.return_logprob and start >= 0:  # SGLang: from `start` on, the first is None
                values = await anyio.to_thread.run_sync(
                    lambda p=prompt: engine.prompt_logprobs(p, req.lora_path)
                )
                inputs = [[None, prompt[0], None]] + [
                    [lp, t, None] for t, lp in zip(prompt[1:], values, strict=True)
                ]
                inputs = inputs[start:]
            outputs += [
                _sglang_output(engine, row, prompt, req, controls.weight_version, inputs)
                for row in rows
            ]
        return JSONResponse(outputs[0] if single and sp.n == 1 else outputs)

    return app


def _check_lengths(engine: HFEngine, prompts: list[list[int]], max_tokens: int) -> str | None:
    for prompt in prompts:
        if not prompt:
            return "prompt must not be empty"
        if any(t < 0 or t >= engine.vocab_size for t in prompt):
            return f"token id out of vocabulary (size {engine.vocab_size})"
        if len(prompt) + max_tokens > engine.max_len:
            return (
                f"This model's maximum context length is {engine.max_len} tokens. However, "
                f"you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                f"messages, {max_tokens} in the completion)."
            )
    return None


def _vllm_choice(
    engine: HFEngine, row: Completion, index: int, req: VllmCompletionRequest
) -> dict[str, Any]:
    text = engine.tokenizer.decode(row.ids, skip_special_tokens=req.skip_special_tokens)
    logprobs = None
    if req.logprobs is not None:

        def name(tok: int) -> str:
            return (
                f"token_id:{tok}"
                if req.return_tokens_as_token_ids
                else engine.tokenizer.convert_ids_to_tokens(tok)
            )

        tokens = [name(t) for t in row.ids]
        offsets, pos = [], 0
        for tok_str in tokens:  # vLLM advances offsets by the returned token string's length
            offsets.append(pos)
            pos += len(tok_str)
        top = []
        for i, tok in enumerate(row.ids):  # sampled token first, then the top alternatives
            entry = {name(tok): max(row.logprobs[i], -9999.0)}
            for alt, lp in row.top[i][: req.logprobs] if row.top else []:
                entry.setdefault(name(alt), max(lp, -9999.0))
            top.append(entry)
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": [max(v, -9999.0) for v in row.logprobs],
            "tokens": tokens,
            "top_logprobs": top,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": row.finish,
        "stop_reason": row.stop_token,
        "prompt_logprobs": None,
        "_ids": row.ids,
    }


def _sglang_output(
    engine: HFEngine,
    row: Completion,
    prompt: list[int],
    req: SglangGenerateRequest,
    weight_version: str,
    input_logprobs: list[list[Any]] | None = None,
) -> dict[str, Any]:
    finish: dict[str, Any] = (
        {"type": "length", "length": len(row.ids)}
        if row.finish == "length"
        else {"type": "stop", "matched": row.ids[-1]}
    )
    meta: dict[str, Any] = {
        "id": req.rid or uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(row.ids),
        "cached_tokens": 0,
        "weight_version": weight_version,
    }
    if req.return_logprob:

        def text(t: int) -> str | None:
            return engine.tokenizer.decode([t]) if req.return_text_in_logprobs else None

        meta["input_token_logprobs"] = input_logprobs or [[None, prompt[-1], text(prompt[-1])]]
        meta["output_token_logprobs"] = [
            [lp, t, text(t)] for lp, t in zip(row.logprobs, row.ids, strict=True)
        ]
    return {
        "text": engine.tokenizer.decode(
            row.ids, skip_special_tokens=req.sampling_params.skip_special_tokens
        ),
        "output_ids": row.ids,
        "meta_info": meta,
    }


def _error(message: str, status: int, kind: str = "BadRequestError") -> JSONResponse:
    if status >= 500:
        kind = "InternalServerError"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


# ---------------------------------------------------------------------------------- serving


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model folder (make_tiny_model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--lora-name", action="append", default=[], dest="lora_names")
    # vLLM's own fallback: VLLM_API_KEY when no --api-key is given
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None)
    parser.add_argument(
        "--logprobs-mode",
        default="processed_logprobs",
        choices=["raw_logprobs", "processed_logprobs"],
    )
    args = parser.parse_args(argv)
    app = create_app(
        args.model,
        served_model_name=args.served_model_name,
        lora_names=tuple(args.lora_names),
        api_key=args.api_key,
        logprobs_mode=args.logprobs_mode,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
