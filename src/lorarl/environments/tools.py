"""Tools a tool-calling environment can offer the model: `calculator` and `python`.

A tool is a name, a description and a JSON schema of its arguments (what the model reads in the
system prompt), plus `run(arguments) -> str`. Bad input from the model (wrong arguments, an
expression that does not evaluate, code that raises) is a `ToolError`, shown to the model as text;
anything else a tool raises is a fault of the machine, not of the model, and propagates.

Nothing here evaluates model text in-process: the calculator walks a small arithmetic AST and the
python tool runs code behind the same OS boundary the code rewards use
(`lorarl.rewards.sandbox.run`).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "BUILTIN_TOOLS",
    "Tool",
    "ToolError",
    "ToolExample",
    "calculator_tool",
    "evaluate_arithmetic",
    "python_tool",
]


class ToolError(ValueError):
    """The model's call was unusable; the message (after `output`, if any) goes back to it."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class ToolExample:
    """One worked call for the system prompt: small models copy formats they have seen."""

    question: str
    arguments: dict[str, Any]
    result: str
    answer: str


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@dataclass(frozen=True)
class Tool:
    """`fn(arguments)` runs after the arguments match `parameters` (a flat JSON object schema)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[[dict[str, Any]], str]
    example: ToolExample | None = field(default=None, compare=False)

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Hermes function schema, as chat templates and the `<tools>` block use it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def run(self, arguments: Any) -> str:
        check_arguments(self.name, self.parameters, arguments)
        return self.fn(arguments)


def check_arguments(name: str, schema: Mapping[str, Any], arguments: Any) -> None:
    """Required keys present, no unknown keys, top-level JSON types right; ToolError otherwise."""
    if not isinstance(arguments, dict):
        raise ToolError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
    props: Mapping[str, Any] = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        raise ToolError(f"{name}: missing argument {', '.join(repr(k) for k in missing)}")
    unknown = sorted(k for k in arguments if k not in props)
    if unknown:
        raise ToolError(
            f"{name}: unknown argument {', '.join(repr(k) for k in unknown)}; "
            f"it takes {', '.join(repr(k) for k in props)}"
        )
    for key, value in arguments.items():
        want = props[key].get("type")
        types = _JSON_TYPES.get(want) if isinstance(want, str) else None
        wrong_bool = isinstance(value, bool) and want in ("integer", "number")
        if types is not None and (not isinstance(value, types) or wrong_bool):
            raise ToolError(f"{name}: argument {key!r} must be a {want}")


# ------------------------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 500
MAX_MAGNITUDE = 10**100  # results and literals beyond this are refused, not computed
_MAX_POW_BITS = MAX_MAGNITUDE.bit_length()
_MAX_EXPONENT = 10_000

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_ALLOWED = "numbers, + - * / // % **, unary minus and parentheses"


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate `expression` by walking its AST; ToolError for anything but plain arithmetic.

    Every intermediate value is bounded by MAX_MAGNITUDE and a power's size is predicted before
    it is computed, so `9**9**9` is refused at once instead of hanging the worker.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("calculator: expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"calculator: expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"calculator: not an arithmetic expression ({_why(exc)})") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("calculator: division by zero") from None
    except (OverflowError, RecursionError, MemoryError):
        raise ToolError("calculator: result too large") from None


def _why(exc: BaseException) -> str:
    return getattr(exc, "msg", None) or type(exc).__name__


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ToolError(f"calculator: only {_ALLOWED} are allowed, not {value!r}")
        return _bounded(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ToolError("calculator: '^' is not a power here; use ** (2**10)")
    raise ToolError(f"calculator: only {_ALLOWED} are allowed")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > _MAX_EXPONENT:
        raise ToolError(f"calculator: exponent {exponent} is too large")
    if not (isinstance(base, int) and isinstance(exponent, int)) or exponent <= 0:
        return  # a float power overflows cheaply (OverflowError); only an int one runs long
    if abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > _MAX_POW_BITS:
        raise ToolError("calculator: result too large")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ToolError("calculator: the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("calculator: result too large")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError("calculator: result too large")
    return value


def format_number(value: int | float) -> str:
    """Integers (and floats that hold one) as integers; other floats to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def calculator_tool() -> Tool:
    return Tool(
        name="calculator",
        description="Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. (12+3)*4"},
            },
            "required": ["expression"],
        },
        fn=lambda args: format_number(evaluate_arithmetic(args["expression"])),
        example=ToolExample(
            question="What is 12*34?",
            arguments={"expression": "12*34"},
            result="408",
            answer="12*34 = 408.",
        ),
    )


# ----------------------------------------------------------------------------------- python

MAX_CODE_CHARS = 20_000

# Runs inside the sandbox: the model's code comes on stdin; a last bare expression is printed,
# as in a notebook, because small models often end with `x` instead of `print(x)`.
_RUNNER = r"""
import ast, io, sys
_src = sys.stdin.read()
sys.stdin = io.StringIO()  # input() gets EOFError, as at the end of a file
_tree = ast.parse(_src, "<code>")
_last = _tree.body.pop() if _tree.body and isinstance(_tree.body[-1], ast.Expr) else None
_ns = {"__name__": "__main__"}
exec(compile(_tree, "<code>", "exec"), _ns)
if _last is not None:
    _value = eval(compile(ast.Expression(_last.value), "<code>", "eval"), _ns)
    if _value is not None:
        print(repr(_value))
"""


def python_tool(timeout_seconds: float = 5.0, memory_mb: int = 256) -> Tool:
    """The python tool; raises SandboxUnavailable (saying what to do) where the sandbox can't
    run, so an environment offering it fails when it is built, never by running code
    unsandboxed."""
    from lorarl.rewards.sandbox.run import SandboxLimits, SandboxUnavailable, check_available

    try:
        check_available()
    except SandboxUnavailable as exc:
        raise SandboxUnavailable(f"tool 'python' needs the code sandbox: {exc}") from None
    limits = SandboxLimits(
        wall_seconds=float(timeout_seconds),
        cpu_seconds=max(1, math.ceil(timeout_seconds)),
        memory_bytes=int(memory_mb) * 1024 * 1024,
        max_output_bytes=64 * 1024,
    )

    def run(args: dict[str, Any]) -> str:
        from lorarl.rewards.sandbox.run import run_python

        code = args["code"]
        if len(code) > MAX_CODE_CHARS:
            raise ToolError(f"python: code longer than {MAX_CODE_CHARS} characters")
        result = run_python(_RUNNER, limits=limits, stdin=code)
        if not result.ok:
            raise ToolError(f"python: {result.reason}", output=result.stdout.rstrip("\n"))
        return result.stdout.rstrip("\n") or "(no output; print what you need)"

    return Tool(
        name="python",
        description="Run Python 3 code in a sandbox and return what it prints (the value of a "
        "last bare expression is printed too). No network, no files kept between calls.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source"}},
            "required": ["code"],
        },
        fn=run,
        example=ToolExample(
            question="What is 12*34?",
            arguments={"code": "print(12*34)"},
            result="408",
            answer="12*34 = 408.",
        ),
    )


# name -> factory; ToolCalling passes the factory the options it accepts (python_* params).
BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {
    "calculator": calculator_tool,
    "python": python_tool,
}
