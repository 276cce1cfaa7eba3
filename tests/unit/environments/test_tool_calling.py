"""`tool_calling`: the `<tool_call>` parser, the calculator against abuse, the tool responses and
counters, reset's system message, and the python tool through the real sandbox."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lorarl.environments import EpisodeItem, Tool, ToolCalling, ToolError, parse_tool_calls
from lorarl.environments.tool_calling import ParsedCall
from lorarl.environments.tools import evaluate_arithmetic, format_number
from lorarl.rewards.sandbox.run import SandboxUnavailable, check_available


def call(name: str, arguments, *, close: bool = True) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n" + ("</tool_call>" if close else "")


def calc(expression: str) -> str:
    return call("calculator", {"expression": expression})


def response(step, i: int = 0) -> str:
    content = step.messages[i]["content"]
    assert step.messages[i]["role"] == "tool"
    assert content.startswith("<tool_response>\n") and content.endswith("\n</tool_response>")
    return content[len("<tool_response>\n") : -len("\n</tool_response>")]


# ---------------------------------------------------------------- parser


def test_parses_one_call_with_surrounding_text():
    text = f"I will compute it.\n{calc('12*34')}\nwait."
    assert parse_tool_calls(text) == [ParsedCall("calculator", {"expression": "12*34"})]


def test_parses_multiple_calls_in_order():
    text = calc("1+1") + "and" + call("python", {"code": "print(2)"})
    assert [c.name for c in parse_tool_calls(text)] == ["calculator", "python"]


def test_arguments_may_be_a_json_string_and_whitespace_is_tolerated():
    text = (
        '<tool_call>  \n\n {"name" : "calculator",\n '
        '"arguments": "{\\"expression\\": \\"2*3\\"}"}\n\n</tool_call>'
    )
    assert parse_tool_calls(text) == [ParsedCall("calculator", {"expression": "2*3"})]


def test_unclosed_call_at_the_end_counts_as_closed():
    assert parse_tool_calls(call("calculator", {"expression": "5"}, close=False)) == [
        ParsedCall("calculator", {"expression": "5"})
    ]


def test_tolerates_fences_raw_newlines_in_strings_and_the_parameters_key():
    fenced = (
        '<tool_call>\n```json\n{"name": "calculator", "arguments": {"expression": "1"}}'
        "\n```\n</tool_call>"
    )
    assert parse_tool_calls(fenced) == [ParsedCall("calculator", {"expression": "1"})]
    raw = '<tool_call>{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}</tool_call>'
    assert parse_tool_calls(raw) == [ParsedCall("python", {"code": "x = 1\nprint(x)"})]
    alias = '<tool_call>{"name": "calculator", "parameters": {"expression": "1"}}</tool_call>'
    assert parse_tool_calls(alias)[0].arguments == {"expression": "1"}


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1"', "not valid JSON"),
        ("calculator(1+1)", "not valid JSON"),
        ("", "not valid JSON"),
        ('["calculator"]', "not a JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "calculator", "arguments": [1]}', '"arguments" must be an object'),
        ('{"name": "calculator", "arguments": "{oops"}', '"arguments" is not JSON'),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_calls_carry_an_error(body, match):
    (parsed,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert parsed.error is not None and match in parsed.error


def test_no_call_is_no_call():
    assert parse_tool_calls("The answer is 408. <tool_response>x</tool_response>") == []


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("123*456", "56088"),
        ("  (1 + 2) * -3 ", "-9"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("6 / 3", "2"),
        ("7 / 2", "3.5"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("-2 ** 2", "-4"),
        ("10 ** 100", "1" + "0" * 100),
        ("1 / 3", "0.333333333333"),
        ("1e20 / 1", "1e+20"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, expected):
    assert format_number(evaluate_arithmetic(expression)) == expected


@pytest.mark.parametrize(
    ("expression", "match"),
    [
        ("9**9**9", "too large"),
        ("2**2**2**2**2", "too large"),
        ("9**9999", "too large"),
        ("(10**99)**(10**99)", "too large"),
        ("10**100 * 10", "too large"),
        ("10.0 ** 400", "too large"),
        ("1e308 * 10", "too large"),
        ("9" * 101, "too large"),
        ("(" * 240 + "1" + ")" * 240, "too many nested parentheses"),
        ("1+" * 300 + "1", "longer than 500"),
        ("1/0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("2 ^ 3", r"use \*\*"),
        ("__import__('os').system('id')", "only numbers"),
        ("open('/etc/passwd').read()", "only numbers"),
        ("(1).__class__", "only numbers"),
        ("[1] * 10**9", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("x + 1", "only numbers"),
        ("1 +", "not an arithmetic expression"),
        ("1; 2", "not an arithmetic expression"),
        ("", "empty"),
    ],
)
def test_calculator_refuses_abuse_quickly(expression, match):
    start = time.monotonic()
    with pytest.raises(ToolError, match=match):
        evaluate_arithmetic(expression)
    assert time.monotonic() - start < 0.5


def test_calculator_never_uses_eval(monkeypatch):
    import builtins

    def no(*args, **kwargs):
        raise AssertionError("eval/exec called")

    monkeypatch.setattr(builtins, "eval", no)
    monkeypatch.setattr(builtins, "exec", no)
    assert format_number(evaluate_arithmetic("(2+3)*4")) == "20"


# ---------------------------------------------------------------- step


def test_no_tool_call_ends_the_episode():
    step = ToolCalling().step("12*34 = 408.")
    assert step.done and step.messages == [] and step.reward == 0.0


def test_calls_get_one_response_each_and_counters():
    env = ToolCalling()
    step = env.step(calc("12*34") + calc("1/0") + call("search", {"q": "x"}) + "<tool_call>{oops")
    assert not step.done and step.reward == 0.0
    assert [response(step, i) for i in range(4)] == [
        "408",
        "error: calculator: division by zero",
        "error: unknown tool 'search'; available: calculator",
        'error: malformed tool call: not valid JSON; expected {"name": "<tool>", '
        '"arguments": {...}}',
    ]
    assert step.info == {"tool_calls": 4.0, "tool_errors": 3.0}


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({}, "calculator: missing argument 'expression'"),
        ({"expression": "1", "precision": 3}, "unknown argument 'precision'"),
        ({"expression": 12}, "argument 'expression' must be a string"),
        ("1+1", "arguments must be a JSON object"),
    ],
)
def test_bad_arguments_are_tool_errors_not_exceptions(arguments, match):
    if isinstance(arguments, str):  # a JSON string that holds no object
        text = '<tool_call>{"name": "calculator", "arguments": "\\"1+1\\""}</tool_call>'
        match = '"arguments" must be an object'
    else:
        text = call("calculator", arguments)
    step = ToolCalling().step(text)
    assert match in response(step) and response(step).startswith("error: ")
    assert step.info == {"tool_calls": 1.0, "tool_errors": 1.0}


def counting_tool(runs: list) -> Tool:
    def run(args):
        runs.append(args["text"])
        return args["text"].upper()

    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    return Tool("shout", "Upper-case a text.", schema, run)


def test_calls_beyond_the_limit_are_answered_but_not_run():
    runs: list = []
    env = ToolCalling(tools=[counting_tool(runs)], max_calls_per_turn=2)
    step = env.step("".join(call("shout", {"text": t}) for t in ("a", "b", "c")))
    assert runs == ["a", "b"]
    assert [response(step, i) for i in range(2)] == ["A", "B"]
    assert response(step, 2).startswith("error: more than 2 tool calls")
    assert step.info == {"tool_calls": 3.0, "tool_errors": 1.0}


def test_a_tool_fault_that_is_not_the_models_propagates():
    def broken(args):
        raise OSError("disk gone")

    tool = Tool("t", "d", {"type": "object", "properties": {}}, broken)
    with pytest.raises(OSError, match="disk gone"):
        ToolCalling(tools=[tool]).step(call("t", {}))


def test_long_responses_are_cut_and_tags_can_be_left_to_the_template():
    env = ToolCalling(max_response_chars=64, response_tags=False)
    step = env.step(calc("10**99"))
    content = step.messages[0]["content"]
    assert content.startswith("1" + "0" * 63 + "\n[... 36 more characters cut]")
    assert "<tool_response>" not in content


# ---------------------------------------------------------------- reset


def schema_lines(system: str) -> list[dict]:
    block = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    return [json.loads(line) for line in block.splitlines()]


def test_reset_puts_the_tools_in_a_new_system_message():
    env = ToolCalling(tools=["calculator"])
    messages = env.reset(EpisodeItem(prompt="What is 7*191?", answer="1337"))
    assert [m["role"] for m in messages] == ["system", "user"]
    system = messages[0]["content"]
    (schema,) = schema_lines(system)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert "<tool_call>" in system and "</tool_call>" in system
    # the worked example is itself a call the environment accepts
    example = system.split("Example:", 1)[1]
    assert parse_tool_calls(example.split("Tool:", 1)[0]) == [
        ParsedCall("calculator", {"expression": "12*34"})
    ]
    assert "<tool_response>\n408\n</tool_response>" in example
    assert len(system) < 1200  # small models read it


def test_reset_appends_to_the_rows_system_message_without_mutating_the_row():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*191?"}]
    messages = ToolCalling(tools=["calculator", "python"]).reset(EpisodeItem(prompt=prompt))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call tools.")
    names = [s["function"]["name"] for s in schema_lines(messages[0]["content"])]
    assert names == ["calculator", "python"]
    assert prompt[0]["content"] == "Be brief."


def test_custom_system_prompt_and_no_example():
    env = ToolCalling(system_prompt="Tools:\n<tools>\n{tools}\n</tools>\nUse them.")
    system = env.reset(EpisodeItem(prompt="q"))[0]["content"]
    assert system.startswith("Tools:\n<tools>\n{") and system.endswith("Use them.")
    assert schema_lines(system)[0]["function"]["name"] == "calculator"
    plain = ToolCalling(example=False).reset(EpisodeItem(prompt="q"))[0]["content"]
    assert "Example:" not in plain and "<tools>" in plain


# ---------------------------------------------------------------- python tool (real sandbox)


def sandbox_or_skip() -> None:
    try:
        check_available()
    except SandboxUnavailable as exc:
        pytest.skip(f"the code sandbox cannot run here: {exc}")


@pytest.fixture(scope="module")
def python_env():
    sandbox_or_skip()
    return ToolCalling(tools=["python"], python_timeout_seconds=1, max_response_chars=200)


def test_python_runs_in_the_sandbox(python_env):
    code = "import os\nprint(os.getpid(), os.path.exists('/work'))\nsum(range(10))"
    step = python_env.step(call("python", {"code": code}))
    pid, work, total = response(step).split()
    assert int(pid) < 10 and int(pid) != os.getpid()  # its own pid namespace, not this process
    assert work == "False"  # the working tree is not mounted
    assert total == "45"  # a last bare expression is printed, as in a notebook
    assert step.info == {"tool_calls": 1.0, "tool_errors": 0.0}


def test_python_errors_keep_the_output_and_the_last_error_line(python_env):
    step = python_env.step(call("python", {"code": "print('partial')\n1/0"}))
    assert response(step) == "partial\nerror: python: ZeroDivisionError: division by zero"
    step = python_env.step(call("python", {"code": "input()"}))
    assert response(step) == "error: python: EOFError: EOF when reading a line"
    step = python_env.step(call("python", {"code": "def f(:\n  pass"}))
    assert response(step).startswith("error: python: SyntaxError")
    assert step.info["tool_errors"] == 1.0


def test_python_output_is_bounded_and_a_hang_is_killed(python_env):
    step = python_env.step(call("python", {"code": "print('x' * 10**7)"}))
    assert response(step).startswith("x" * 200 + "\n[... ")
    start = time.monotonic()
    step = python_env.step(call("python", {"code": "while True:\n    pass"}))
    assert "error: python: wall-clock limit of 1 s exceeded" in response(step)
    assert time.monotonic() - start < 5
    quiet = python_env.step(call("python", {"code": "x = 1"}))
    assert response(quiet) == "(no output; print what you need)"


def test_the_docs_show_the_real_system_text():
    docs = (Path(__file__).parents[3] / "docs" / "environments.md").read_text()
    block = docs.split("```text\n", 1)[1].split("```", 1)[0]
    system = ToolCalling().reset(EpisodeItem(prompt="q"))[0]["content"]
    for line in system.splitlines():
        if not line.startswith('{"type": "function"'):  # the doc abbreviates the schema
            assert line in block.splitlines(), line


def test_call_reward_pays_the_first_successful_call_of_an_episode_once():
    env = ToolCalling(call_reward=0.2)
    assert env.step(call("calculator", {"expression": "1/0"})).reward == 0.0  # a failed call
    assert env.step(call("calculator", {"expression": "2*3"})).reward == 0.2
    assert env.step(call("calculator", {"expression": "4*5"})).reward == 0.0  # paid already
    assert ToolCalling().step(call("calculator", {"expression": "2*3"})).reward == 0.0
    with pytest.raises(ValueError, match="call_reward must be a number in"):
        ToolCalling.check_params(call_reward=2)
