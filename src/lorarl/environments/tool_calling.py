"""`tool_calling`: the model may call tools (calculator, python) before it gives its answer."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lorarl.environments.base import EnvStep, EpisodeItem, Message, item_messages
from lorarl.environments.tools import BUILTIN_TOOLS, Tool, ToolError

__all__ = ["ParsedCall", "ToolCalling", "parse_tool_calls"]

# An unclosed call at the end counts: engines often stop on `</tool_call>` and drop it.
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = re.compile(r"\A```[a-zA-Z]*\s*\n?(.*?)\n?\s*```\Z", re.DOTALL)
_FORMAT_HINT = 'expected {"name": "<tool>", "arguments": {...}}'

DEFAULT_SYSTEM_PROMPT = """\
You can call tools. Their signatures, in <tools></tools>:
<tools>
{tools}
</tools>
To call a tool, reply with:
<tool_call>
{"name": "<tool name>", "arguments": {<arguments as JSON>}}
</tool_call>
The result comes back in <tool_response></tool_response>. \
When you know the answer, reply with it and no tool call."""


@dataclass(frozen=True)
class ParsedCall:
    """One `<tool_call>` of a reply: a name and arguments, or why it could not be read."""

    name: str | None = None
    arguments: dict[str, Any] | None = None
    error: str | None = None


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every `<tool_call>` block of `text`, in order; malformed ones carry an `error`."""
    return [_parse_one(m.group(1)) for m in _CALL.finditer(text)]


def _parse_one(body: str) -> ParsedCall:
    body = body.strip()
    fenced = _FENCE.match(body)  # ```json ... ``` inside the tags
    if fenced:
        body = fenced.group(1).strip()
    try:
        obj = json.loads(body, strict=False)  # raw newlines inside strings (code)
    except (ValueError, RecursionError):
        return ParsedCall(error=f"malformed tool call: not valid JSON; {_FORMAT_HINT}")
    if not isinstance(obj, dict):
        return ParsedCall(error=f"malformed tool call: not a JSON object; {_FORMAT_HINT}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ParsedCall(error=f'malformed tool call: no "name"; {_FORMAT_HINT}')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # models emit both an object and a JSON string holding one
        try:
            args = json.loads(args, strict=False) if args.strip() else {}
        except (ValueError, RecursionError):
            return ParsedCall(name=name, error='malformed tool call: "arguments" is not JSON')
    if not isinstance(args, dict):
        return ParsedCall(name=name, error='malformed tool call: "arguments" must be an object')
    return ParsedCall(name=name.strip(), arguments=args)


class ToolCalling:
    """Multi-turn tool use in the Hermes / Qwen2.5 format.

    reset: the row's messages with the tool description in the system message (appended to the
    row's own system message, else a new one in front): a `<tools>` block with one JSON function
    schema per line, how to call, and one worked example.

    The model calls a tool by writing, anywhere in its reply, one or more

        <tool_call>
        {"name": "calculator", "arguments": {"expression": "12*34"}}
        </tool_call>

    ("arguments" may also be a JSON string holding the object; a missing closing tag at the end
    of the reply counts as closed). step runs up to `max_calls_per_turn` calls in order and
    answers each with one message
    `{"role": "tool", "content": "<tool_response>\\n408\\n</tool_response>"}`; a call that fails
    (unknown tool, malformed JSON, bad arguments, an error in the tool) is answered with
    `error: ...` inside the same tags, so the model can correct itself. Calls beyond the limit are
    answered with an error and not run. Such a step has reward 0 (`call_reward` for the
    episode's first step with a successful call: a shaping bonus that lets RL reinforce the
    format before the model gets answers right), `done=False` and
    `info={"tool_calls": n, "tool_errors": k}`. A reply with no tool call is the final answer:
    `done=True` (the episode's reward comes from spec.reward).

    Params: `tools` (names from BUILTIN_TOOLS; Tool objects too, from Python), `system_prompt`
    (replaces the default text; must contain `{tools}`, where the schemas go), `example`
    (include the worked example), `max_calls_per_turn`, `max_response_chars` (a tool's text is
    cut beyond it), `response_tags` (set false for chat templates that wrap tool messages in
    `<tool_response>` themselves, such as Qwen2.5's), `python_timeout_seconds`,
    `python_memory_mb` (the python tool's sandbox limits), `call_reward` (default 0).
    """

    def __init__(
        self,
        tools: Sequence[str | Tool] = ("calculator",),
        system_prompt: str | None = None,
        example: bool = True,
        max_calls_per_turn: int = 4,
        max_response_chars: int = 2000,
        response_tags: bool = True,
        python_timeout_seconds: float = 5.0,
        python_memory_mb: int = 256,
        call_reward: float = 0.0,
    ) -> None:
        self.check_params(
            tools=tools,
            system_prompt=system_prompt,
            example=example,
            max_calls_per_turn=max_calls_per_turn,
            max_response_chars=max_response_chars,
            response_tags=response_tags,
            python_timeout_seconds=python_timeout_seconds,
            python_memory_mb=python_memory_mb,
            call_reward=call_reward,
        )
        self.call_reward = float(call_reward)
        self._call_rewarded = False  # one instance per episode: the bonus is paid once
        options = {"timeout_seconds": python_timeout_seconds, "memory_mb": python_memory_mb}
        self.tools: dict[str, Tool] = {}
        for t in tools:
            tool = t if isinstance(t, Tool) else _build(t, options)
            self.tools[tool.name] = tool
        self.max_calls_per_turn = max_calls_per_turn
        self.max_response_chars = max_response_chars
        self.response_tags = response_tags
        self.system_text = _system_text(list(self.tools.values()), system_prompt, example)

    @staticmethod
    def check_params(
        tools: Any = ("calculator",),
        system_prompt: Any = None,
        example: Any = True,
        max_calls_per_turn: Any = 4,
        max_response_chars: Any = 2000,
        response_tags: Any = True,
        python_timeout_seconds: Any = 5.0,
        python_memory_mb: Any = 256,
        call_reward: Any = 0.0,
    ) -> None:
        """ValueError naming the param; builds nothing (the admission webhook calls it)."""
        if isinstance(tools, str) or not isinstance(tools, Sequence) or not tools:
            raise ValueError("tools must be a non-empty list of tool names")
        names = []
        for t in tools:
            if isinstance(t, Tool):
                names.append(t.name)
            elif isinstance(t, str) and t in BUILTIN_TOOLS:
                names.append(t)
            else:
                raise ValueError(
                    f"tools: unknown tool {t!r}; known tools: {', '.join(sorted(BUILTIN_TOOLS))}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"tools: a tool is listed twice: {names}")
        if system_prompt is not None and (
            not isinstance(system_prompt, str) or "{tools}" not in system_prompt
        ):
            raise ValueError("system_prompt must be a string containing {tools}")
        for name, value, low, high in (
            ("max_calls_per_turn", max_calls_per_turn, 1, 64),
            ("max_response_chars", max_response_chars, 64, 1_000_000),
            ("python_memory_mb", python_memory_mb, 64, 16384),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}] (got {value!r})")
        t = python_timeout_seconds
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 300:
            raise ValueError(f"python_timeout_seconds must be a number in (0, 300] (got {t!r})")
        c = call_reward
        if isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c <= 1:
            raise ValueError(f"call_reward must be a number in [0, 1] (got {c!r})")
        for name, value in (("example", example), ("response_tags", response_tags)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false (got {value!r})")

    def reset(self, item: EpisodeItem) -> list[Message]:
        messages = item_messages(item.prompt)
        first = messages[0] if messages else None
        if (
            first is not None
            and first.get("role") == "system"
            and isinstance(first.get("content"), str)
        ):
            first["content"] = f"{first['content'].rstrip()}\n\n{self.system_text}"
        else:
            messages.insert(0, {"role": "system", "content": self.system_text})
        return messages

    def step(self, assistant: str) -> EnvStep:
        calls = parse_tool_calls(assistant)
        if not calls:
            return EnvStep(done=True)
        replies, errors = [], 0
        for i, call in enumerate(calls):
            ok, text = self._answer(call, over_limit=i >= self.max_calls_per_turn)
            errors += not ok
            replies.append({"role": "tool", "content": self._wrap(text)})
        reward = 0.0
        if errors < len(calls) and not self._call_rewarded:
            reward, self._call_rewarded = self.call_reward, True
        return EnvStep(
            messages=replies,
            reward=reward,
            done=False,
            info={"tool_calls": float(len(calls)), "tool_errors": float(errors)},
        )

    def _answer(self, call: ParsedCall, *, over_limit: bool) -> tuple[bool, str]:
        if over_limit:
            return False, (
                f"error: more than {self.max_calls_per_turn} tool calls in one reply; "
                "this one was not run"
            )
        if call.error is not None:
            return False, f"error: {call.error}"
        tool = self.tools.get(call.name or "")
        if tool is None:
            return False, (f"error: unknown tool {call.name!r}; available: {', '.join(self.tools)}")
        try:
            return True, self._cut(tool.run(call.arguments))
        except ToolError as exc:
            partial = self._cut(exc.output) + "\n" if exc.output else ""
            return False, f"{partial}error: {exc}"

    def _cut(self, text: str) -> str:
        if len(text) <= self.max_response_chars:
            return text
        more = len(text) - self.max_response_chars
        return f"{text[: self.max_response_chars]}\n[... {more} more characters cut]"

    def _wrap(self, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>" if self.response_tags else text


def _build(name: str, options: dict[str, Any]) -> Tool:
    factory = BUILTIN_TOOLS[name]
    return factory(**options) if name == "python" else factory()


def _system_text(tools: list[Tool], system_prompt: str | None, example: bool) -> str:
    schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)
    text = (system_prompt or DEFAULT_SYSTEM_PROMPT).replace("{tools}", schemas)
    if system_prompt is not None or not example:
        return text
    tool = next((t for t in tools if t.example is not None), None)
    if tool is None:
        return text
    ex = tool.example
    assert ex is not None
    call = json.dumps({"name": tool.name, "arguments": ex.arguments}, ensure_ascii=False)
    return (
        f"{text}\n\nExample:\nUser: {ex.question}\n"
        f"Assistant: <tool_call>\n{call}\n</tool_call>\n"
        f"Tool: <tool_response>\n{ex.result}\n</tool_response>\n"
        f"Assistant: {ex.answer}"
    )
