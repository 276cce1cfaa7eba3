"""The OpenAI-compatible endpoint agent episodes call (`spec.agent`,
docs/environments.md#agents-through-an-openai-compatible-endpoint).

Served on trainer rank 0's loopback for the length of a step's episodes. Each episode has its own
key (`Authorization: Bearer <key>`); a chat request renders the conversation with the tokenizer's
chat template (tools through its `tools=` argument), a completions request takes a string prompt
(tokenized as vLLM would) or token ids as they are; the token ids go to the engines through the
job's `RolloutClient` (the step's sampling params, versioned adapter and stale-policy guard), and
the call is recorded: prompt ids, the completion ids as the engine produced them, its logprobs and
the weight version. The reply's content is the decoded completion; Hermes/Qwen `<tool_call>`
blocks become OpenAI `tool_calls` when the request declared tools. `stream: true` replays the
finished completion as OpenAI's server-sent chunks (the engines are called without streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lorarl.environments.tool_calling import DEFAULT_SYSTEM_PROMPT, parse_tool_calls
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.types import Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EpisodeCalls:
    """One episode's session: what its calls sample with, and every call recorded so far."""

    params: SamplingParams
    model: str
    version: int
    max_calls: int
    seed_base: int | None  # the episode's block of seeds: call i gets seed_base + i
    calls: list[Sample] = field(default_factory=list)  # in the order they were requested
    roles: list[str] = field(default_factory=list)  # each call's request `model`: its role
    requested: int = 0
    order: list[int] = field(default_factory=list)  # each recorded call's request index
    # a tool call's id -> the raw text of the reply that made it (templates without tools)
    replies: dict[str, str] = field(default_factory=dict)

    def record(self, index: int, sample: Sample, role: str) -> None:
        """Keep the calls in request order (concurrent calls can finish in any order)."""
        at = sum(i < index for i in self.order)
        self.order.insert(at, index)
        self.calls.insert(at, sample)
        self.roles.insert(at, role)


class _ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


class AgentEndpoint:
    """`/v1/chat/completions`, `/v1/completions` and `/v1/models` over the job's engines,
    per-episode keys."""

    def __init__(
        self,
        client: RolloutClient,
        tokenizer: Any,
        *,
        max_prompt_tokens: int,
        max_response_tokens: int,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        served_name: str = "policy",
    ) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.client, self.tokenizer = client, tokenizer
        self.max_prompt_tokens, self.max_response_tokens = max_prompt_tokens, max_response_tokens
        self.kwargs = dict(chat_template_kwargs or {})
        self.served_name = served_name
        template = getattr(tokenizer, "chat_template", None)
        # A template without tool support (SmolLM2's) drops `tools` and tool calls: the endpoint
        # then writes them in the Hermes format the tool_calling environment uses.
        self.template_tools = not isinstance(template, str) or "tools" in template
        self.episodes: dict[str, EpisodeCalls] = {}
        # The first generation failure (engines down after retries, a stale policy, a bad
        # answer): raised by the runner once the step's episodes end, as any rollout's would be.
        self.engine_error: Exception | None = None
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )

    def open(self, calls: EpisodeCalls) -> str:
        """A new episode's key; its calls are recorded into `calls`."""
        key = "lorarl-ep-" + secrets.token_urlsafe(24)
        self.episodes[key] = calls
        return key

    def close(self, key: str) -> EpisodeCalls | None:
        """Stop serving the key (a call still in flight finishes; later ones get 401)."""
        return self.episodes.pop(key, None)

    # ------------------------------------------------------------------ handlers

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._episode(request)
        except _ApiError as exc:
            return _error(exc)
        model = {"id": self.served_name, "object": "model", "created": 0, "owned_by": "lorarl"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, self.chat, _chat_chunks)

    async def _completions(self, request: Any) -> Any:
        return await self._serve(request, self.complete, _completion_chunks)

    async def _serve(self, request: Any, answer: Any, chunks: Any) -> Any:
        """Authenticate, answer, and reply as JSON or, with `stream: true`, as server-sent events
        (the whole completion is generated first: the events replay it in OpenAI's chunks)."""
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            episode = self._episode(request)
            try:
                body = await request.json()
            except ValueError as exc:
                raise _bad(f"the body is not JSON: {exc}") from exc
            reply = await answer(episode, body)
        except _ApiError as exc:
            return _error(exc)
        if not body.get("stream"):
            return JSONResponse(reply)
        options = body.get("stream_options")
        usage = isinstance(options, dict) and bool(options.get("include_usage"))
        events = [f"data: {json.dumps(c)}\n\n" for c in chunks(reply, usage)]
        events.append("data: [DONE]\n\n")
        return StreamingResponse(iter(events), media_type="text/event-stream")

    def _episode(self, request: Any) -> EpisodeCalls:
        auth = request.headers.get("authorization", "")
        key = auth[len("Bearer ") :].strip() if auth.startswith("Bearer ") else ""
        episode = self.episodes.get(key)
        if episode is None:
            raise _ApiError(
                401, "unknown or finished episode key", "invalid_request_error", "invalid_api_key"
            )
        return episode

    async def chat(self, episode: EpisodeCalls, body: Any) -> dict[str, Any]:
        """One chat completion for `episode` (the body as the OpenAI API takes it)."""
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise _bad("messages must be a list")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise _bad("tools must be a list")
        _check_common(body)
        index = self._claim(episode)
        prompt_ids = self.render(body["messages"], tools, episode.replies)
        sample = await self._generate(episode, index, prompt_ids, body)
        text = self.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish: str = sample.finish_reason
        if tools is not None and body.get("tool_choice") != "none" and "<tool_call>" in text:
            calls = [c for c in parse_tool_calls(text) if c.error is None]
            if calls:
                message["content"] = text[: text.index("<tool_call>")].strip() or None
                message["tool_calls"] = [
                    {
                        "id": f"call_{index}_{i}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for i, c in enumerate(calls)
                ]
                for call in message["tool_calls"]:
                    episode.replies[call["id"]] = text
                finish = "tool_calls"
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._token_logprobs(sample), "refusal": None}
        reply = _reply("chatcmpl", "chat.completion", body, self, choice, sample)
        if body.get("return_token_ids"):  # vLLM's extension (the SDK's extra_body)
            choice["token_ids"] = list(sample.completion_ids)
            reply["prompt_token_ids"] = list(sample.prompt_ids)
        return reply

    async def complete(self, episode: EpisodeCalls, body: Any) -> dict[str, Any]:
        """One text completion for `episode`: `prompt` is a string (tokenized as vLLM does, with
        the tokenizer's special tokens) or token ids (sent as they are: token-in/token-out)."""
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            prompt_ids = list(self.tokenizer(prompt)["input_ids"])
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            prompt_ids = list(prompt)
        else:
            raise _bad(
                "prompt must be one non-empty string or one list of token ids (one call, one "
                "sample)"
            )
        if body.get("echo") or body.get("suffix") or (body.get("best_of") or 1) != 1:
            raise _bad("echo, suffix and best_of are not supported")
        _check_common(body)
        index = self._claim(episode)
        sample = await self._generate(episode, index, prompt_ids, body)
        text = self.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        choice: dict[str, Any] = {
            "index": 0, "text": text, "finish_reason": sample.finish_reason, "logprobs": None
        }  # fmt: skip
        if body.get("logprobs") is not None:
            tokens = [self.tokenizer.decode([t]) for t in sample.completion_ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": list(sample.logprobs),
                "text_offset": offsets,
                "top_logprobs": None,
            }
        if body.get("return_token_ids"):  # vLLM's extension (the SDK's extra_body)
            choice["prompt_token_ids"] = list(sample.prompt_ids)
            choice["token_ids"] = list(sample.completion_ids)
        return _reply("cmpl", "text_completion", body, self, choice, sample)

    def _claim(self, episode: EpisodeCalls) -> int:
        """The call's index in the episode (its seed), or 429 past agent.maxCalls."""
        if episode.requested >= episode.max_calls:
            raise _ApiError(
                429, f"this episode made its {episode.max_calls} calls (agent.maxCalls)",
                "rate_limit_error",
            )  # fmt: skip
        episode.requested += 1
        return episode.requested - 1

    async def _generate(
        self, episode: EpisodeCalls, index: int, prompt_ids: list[int], body: dict[str, Any]
    ) -> Sample:
        """Generate from the token ids with the step's sampling params and record the call."""
        if len(prompt_ids) > self.max_prompt_tokens:
            raise _ApiError(
                400, f"the prompt is {len(prompt_ids)} tokens, over data.maxPromptTokens="
                f"{self.max_prompt_tokens}", "invalid_request_error", "context_length_exceeded",
            )  # fmt: skip
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = self.max_response_tokens
        if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 1:
            max_tokens = min(max_tokens, asked)
        seed = None if episode.seed_base is None else episode.seed_base + index
        params = replace(episode.params, max_tokens=max_tokens, seed=seed)
        try:
            [[sample]] = await self.client.agenerate(
                [prompt_ids], 1, params, model=episode.model, expected_version=episode.version
            )
        except Exception as exc:  # the engines' failure, not the agent's: the step fails
            self.engine_error = self.engine_error or exc
            raise _ApiError(503, f"the engines failed: {exc}", "server_error") from exc
        model = body.get("model")
        episode.record(index, sample, model if isinstance(model, str) else "")
        return sample

    def _token_logprobs(self, sample: Sample) -> list[dict[str, Any]]:
        out = []
        for tok, lp in zip(sample.completion_ids, sample.logprobs, strict=True):
            text = self.tokenizer.decode([tok])
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": []})  # fmt: skip
        return out

    def render(
        self,
        messages: Sequence[Any],
        tools: list[Any] | None,
        replies: Mapping[str, str] | None = None,
    ) -> list[int]:
        """The prompt's token ids: the chat template's rendering (generation prompt on)."""
        try:
            normal = [_message(m) for m in messages]
            kwargs = dict(self.kwargs)
            if not self.template_tools:
                normal = _hermes(normal, tools, replies or {})
            elif tools is not None:
                kwargs["tools"] = tools
            text = self.tokenizer.apply_chat_template(
                normal, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except _ApiError:
            raise
        except Exception as exc:  # the template refused the conversation
            raise _ApiError(
                400, f"cannot render the messages: {exc}", "invalid_request_error"
            ) from exc
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _message(m: Any) -> dict[str, Any]:
    """An OpenAI message as chat templates take it: text content, tool-call arguments as dicts."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _ApiError(400, f"a message must have a role, got {m!r:.80}", "invalid_request_error")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # content parts: the text ones
        out["content"] = "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    elif content is None:
        out["content"] = ""
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            fn = dict(call.get("function") or {})
            args = fn.get("arguments")
            if isinstance(args, str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(args)
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


def _hermes(
    messages: list[dict[str, Any]], tools: list[Any] | None, replies: Mapping[str, str]
) -> list[dict[str, Any]]:
    """Tools in the Hermes format, for a chat template that has no `tools`: an assistant turn
    with tool calls as the text its reply had (what the model wrote), else as `<tool_call>`
    blocks; tool results inside `<tool_response>` tags; the tools' schemas in the system
    message unless a message already holds a `<tools>` block (the agent wrote its own)."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None) if m["role"] == "assistant" else None
        if calls:
            raw = {replies.get(str(c.get("id"))) for c in calls}
            if len(raw) == 1 and (text := raw.pop()) is not None:
                m["content"] = text
            else:
                blocks = [
                    "<tool_call>\n" + json.dumps(
                        {"name": (c.get("function") or {}).get("name"),
                         "arguments": (c.get("function") or {}).get("arguments")},
                        ensure_ascii=False,
                    ) + "\n</tool_call>"
                    for c in calls
                ]  # fmt: skip
                m["content"] = "\n".join(x for x in [m.get("content") or "", *blocks] if x)
        elif m["role"] == "tool" and not str(m.get("content")).lstrip().startswith(
            "<tool_response>"
        ):
            m["content"] = f"<tool_response>\n{m.get('content')}\n</tool_response>"
        out.append(m)
    if tools and not any("<tools>" in str(m.get("content") or "") for m in out):
        schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = DEFAULT_SYSTEM_PROMPT.replace("{tools}", schemas)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0].get('content') or ''}\n\n{text}".lstrip()
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _check_common(body: dict[str, Any]) -> None:
    if body.get("n", 1) not in (1, None):
        raise _bad("n must be 1 (one call, one sample)")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise _bad("stream must be a boolean")


def _reply(
    prefix: str, kind: str, body: dict[str, Any], endpoint: AgentEndpoint,
    choice: dict[str, Any], sample: Sample,
) -> dict[str, Any]:  # fmt: skip
    n_prompt, n_out = len(sample.prompt_ids), len(sample.completion_ids)
    return {
        "id": f"{prefix}-{secrets.token_hex(12)}",
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model") or endpoint.served_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
        },
    }


def _chat_chunks(reply: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A chat completion as OpenAI streams it: the role, the content, each tool call whole, the
    finish reason, then (stream_options.include_usage) the usage in a chunk without choices."""
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    [choice] = reply["choices"]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        out = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None, **extra}
        return {**head, "choices": [out]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}, logprobs=choice["logprobs"]))
    for i, call in enumerate(message.get("tool_calls") or []):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, choice["finish_reason"]))
    if usage:
        chunks.append({**head, "choices": [], "usage": reply["usage"]})
    return chunks


def _completion_chunks(reply: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A text completion as OpenAI streams it: the text, then the finish reason (and usage)."""
    head = {k: reply[k] for k in ("id", "object", "created", "model")}
    [choice] = reply["choices"]
    chunks = [
        {**head, "choices": [{**choice, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                              "finish_reason": choice["finish_reason"]}]},
    ]  # fmt: skip
    if usage:
        chunks.append({**head, "choices": [], "usage": reply["usage"]})
    return chunks


def _bad(message: str) -> _ApiError:
    return _ApiError(400, message, "invalid_request_error")


def _error(exc: _ApiError) -> Any:
    from starlette.responses import JSONResponse

    body = {"error": {"message": exc.message, "type": exc.kind, "param": None, "code": exc.code}}
    return JSONResponse(body, status_code=exc.status)


class _Server:
    """uvicorn on a loopback socket, inside the running event loop, without signal handlers (the
    trainer's stay in charge)."""

    def __init__(self, app: Any, host: str = "127.0.0.1") -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self.server = Quiet(config)
        self.task: asyncio.Task | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def __aenter__(self) -> _Server:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why it stopped
                raise RuntimeError("the agent endpoint stopped while starting")
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


def serve(app: Any) -> _Server:
    """`async with serve(app) as s:` the app at `s.base_url` while the block runs."""
    return _Server(app)
