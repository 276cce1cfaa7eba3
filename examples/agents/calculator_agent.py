"""An agent for `spec.agent`: a plain openai-SDK tool loop with a calculator tool.

    spec:
      agent:
        entrypoint: examples/agents/calculator_agent.py:run   # or mypackage.agents:run
        maxConcurrency: 32
        timeoutSeconds: 120

lorarl calls `run` once per episode with an `openai.AsyncOpenAI` client pointed at the trainer's
OpenAI-compatible endpoint (its own key per episode). Every model call made through it is recorded
token-exactly and trained on with the reward returned here. Any framework works the same way if
configured with `ctx.base_url` and `ctx.api_key`.

The tools go in `tools=` as usual; the system message also lists them in a `<tools>` block, the
way models whose chat template has no tool support (SmolLM2) learned to read them (with a template
that has tools, the template's own description comes as well). Small models copy turns, not
instructions: give them worked calls in the conversation (data_tasks.with_tool_demos).

`run_with_server` is the same agent with its tool in a server of its own, the way an MCP or any
HTTP tool server runs beside an agent: a separate process on the trainer pod's loopback, started
once per trainer process by the first episode that needs it (`python calculator_agent.py
--serve` runs it by hand), gone when the trainer process goes.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression, e.g. 12*(3+4).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
SYSTEM = "You can call tools:\n<tools>\n" + "\n".join(json.dumps(t) for t in TOOLS) + "\n</tools>"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}  # fmt: skip


def calculator(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only + - * / and numbers")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except Exception as exc:  # the model sees the error and may try again
        return f"error: {exc}"


async def run(
    client, sample, ctx, max_rounds: int = 3, tool: Callable[[str], Awaitable[str]] | None = None
):
    messages = list(sample.messages)
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    rounds, text = 0, ""  # rounds: replies that called the calculator
    for _ in range(max_rounds):
        reply = await client.chat.completions.create(
            model=ctx.model, messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        text = message.content or ""
        if not message.tool_calls:
            break  # the final answer
        rounds += 1
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            expression = str(args.get("expression", ""))
            result = await tool(expression) if tool else calculator(expression)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    right = bool(numbers) and numbers[-1] == str(sample.answer).strip()
    return {"reward": float(right), "tool_rounds": float(rounds)}


async def run_with_server(client, sample, ctx):
    import httpx

    async with httpx.AsyncClient(base_url=tool_server(), timeout=10) as http:

        async def remote(expression: str) -> str:
            response = await http.post("/calculator", json={"expression": expression})
            response.raise_for_status()  # a dead server fails the episode (agent.retries)
            return response.json()["result"]

        return await run(client, sample, ctx, tool=remote)


_server: subprocess.Popen[str] | None = None
_server_url = ""
_server_lock = threading.Lock()


def tool_server() -> str:
    """The tool server's URL, starting it (this file with --serve) on first use or after it
    died. Its stdin is a pipe from this process: when this process ends, so does the server."""
    global _server, _server_url
    with _server_lock:
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen(
                [sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert _server.stdout is not None
            _server_url = _server.stdout.readline().strip()  # its first line: where it listens
            if not _server_url:
                raise RuntimeError("the calculator tool server did not start")
        return _server_url


class _Calculator(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            expression = str(json.loads(self.rfile.read(length))["expression"])
        except (ValueError, KeyError, TypeError):
            self.send_error(400, 'expected {"expression": "..."}')
            return
        body = json.dumps({"result": calculator(expression)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per call would flood the trainer's log
        pass


def serve() -> None:
    """The tool server: loopback only, on a free port it prints first; exits when stdin closes."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Calculator)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sys.stdin.read()  # until the parent's end of the pipe closes


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
