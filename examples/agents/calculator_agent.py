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
"""

from __future__ import annotations

import ast
import json
import operator
import re

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


async def run(client, sample, ctx, max_rounds: int = 3):
    messages = list(sample.messages)
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": SYSTEM})
    start, text = len(messages), ""
    for _ in range(max_rounds):
        reply = await client.chat.completions.create(
            model=ctx.model, messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        text = message.content or ""
        if not message.tool_calls:
            break  # the final answer
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            args = json.loads(call.function.arguments or "{}")
            result = calculator(str(args.get("expression", "")))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    right = bool(numbers) and numbers[-1] == str(sample.answer).strip()
    return {"reward": float(right), "tool_rounds": float(len(messages) - start)}
