"""The environment registry (admission check, factory, its errors) and `single_turn`."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lorarl.environments import (
    BUILTIN_ENVIRONMENTS,
    Environment,
    EnvStep,
    EpisodeItem,
    SingleTurn,
    ToolCalling,
    UnknownEnvironmentError,
    check_environment,
    environment_factory,
    list_environments,
)
from lorarl.rewards.sandbox import isolation
from lorarl.rewards.sandbox.run import SandboxUnavailable

USER_MODULE = '''
"""A user's environments, as they would live in the job's image."""

BUILT = []


class Guess:
    def __init__(self, secret=7, history=None):
        if not isinstance(secret, int):
            raise ValueError(f"secret must be an int, got {secret!r}")
        self.secret = secret
        self.history = history if history is not None else []
        BUILT.append(self)

    def reset(self, item):
        self.history.append("reset")
        return [{"role": "user", "content": "Guess my number."}]

    def step(self, text):
        from lorarl.environments import EnvStep
        return EnvStep(reward=float(text.strip() == str(self.secret)), done=True)


class AsyncGuess(Guess):
    async def reset(self, item):
        return [{"role": "user", "content": "Guess."}]

    async def step(self, text):
        from lorarl.environments import EnvStep
        return EnvStep(done=True)


class NoStep:
    def reset(self, item):
        return []


class Broken:
    def __init__(self):
        raise RuntimeError("database is down")

    def reset(self, item):
        return []

    def step(self, text):
        return None


NOT_A_CLASS = 3
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    name = f"user_envs_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


# ---------------------------------------------------------------- admission check


def test_builtins_are_listed():
    assert list_environments() == ["single_turn", "tool_calling"]
    assert BUILTIN_ENVIRONMENTS["tool_calling"] is ToolCalling


def test_unknown_builtin_names_the_known_ones():
    with pytest.raises(UnknownEnvironmentError, match=r"'tool_use'.*single_turn, tool_calling"):
        check_environment("tool_use", {})
    assert issubclass(UnknownEnvironmentError, ValueError)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"tools": ["calculator", "shell"]}, r"tools: unknown tool 'shell'.*calculator, python"),
        ({"tools": "calculator"}, "tools must be a non-empty list"),
        ({"tools": []}, "tools must be a non-empty list"),
        ({"tools": ["calculator", "calculator"]}, "listed twice"),
        ({"max_calls_per_turn": "4"}, r"max_calls_per_turn must be an integer in \[1, 64\]"),
        ({"max_calls_per_turn": True}, "max_calls_per_turn must be an integer"),
        ({"max_calls_per_turn": 0}, "max_calls_per_turn"),
        ({"python_timeout_seconds": -1}, "python_timeout_seconds must be a number"),
        ({"python_memory_mb": 8}, "python_memory_mb"),
        ({"system_prompt": "Use tools."}, r"system_prompt must be a string containing \{tools\}"),
        ({"response_tags": "no"}, "response_tags must be true or false"),
        (
            {"toolz": ["calculator"]},
            r"invalid params \['toolz'\].*accepts: tools, system_prompt",
        ),
    ],
)
def test_bad_tool_calling_params_name_the_param(params, match):
    with pytest.raises(ValueError, match=match) as info:
        check_environment("tool_calling", params)
    assert "environment 'tool_calling'" in str(info.value)


def test_single_turn_takes_no_params():
    check_environment("single_turn", {})
    check_environment(" single_turn ", None)
    with pytest.raises(ValueError, match="it accepts: no params"):
        check_environment("single_turn", {"tools": ["calculator"]})


def test_good_params_pass():
    check_environment(
        "tool_calling",
        {"tools": ["calculator", "python"], "max_calls_per_turn": 2, "system_prompt": "{tools}"},
    )


def test_user_entrypoints_are_not_imported_at_admission():
    check_environment("not_installed_here.envs:Game", {"anything": [1, 2]})
    assert "not_installed_here" not in sys.modules
    for bad in (":Game", "module:", "a:b:c"):
        with pytest.raises(ValueError, match=r"expected 'package\.module:Class'"):
            check_environment(bad, {})
    for bad in ("", "  ", None):
        with pytest.raises(ValueError, match="non-empty string"):
            check_environment(bad, {})
    with pytest.raises(ValueError, match="params must be a mapping"):
        check_environment("single_turn", ["tools"])


def test_admission_imports_nothing_heavy_and_never_touches_the_sandbox():
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["PATH"] = "/nonexistent"  # no bubblewrap: the python tool cannot be built
        from lorarl.environments.registry import check_environment
        check_environment("tool_calling", {"tools": ["calculator", "python"]})
        heavy = {"torch", "transformers", "httpx", "numpy", "lorarl.rewards.sandbox.run"}
        print(sorted(heavy & set(sys.modules)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout.strip().replace("'", '"')) == []


# ---------------------------------------------------------------- factory


def test_factory_builds_fresh_builtin_instances():
    factory = environment_factory("tool_calling", {"tools": ["calculator"]})
    a, b = factory(), factory()
    assert isinstance(a, ToolCalling) and a is not b
    assert isinstance(a, Environment)
    assert list(a.tools) == ["calculator"]


def test_factory_refuses_what_admission_refuses():
    with pytest.raises(ValueError, match="unknown tool 'shell'"):
        environment_factory("tool_calling", {"tools": ["shell"]})
    with pytest.raises(UnknownEnvironmentError):
        environment_factory("nope", {})


def test_factory_imports_a_user_class_and_builds_one_eagerly(user_module):
    factory = environment_factory(f"{user_module}:Guess", {"secret": 3, "history": []})
    module = sys.modules[user_module]
    assert len(module.BUILT) == 1  # built once at start, so bad params fail there
    env = factory()
    assert env is not module.BUILT[0] and env.secret == 3
    env.reset(EpisodeItem(prompt="x"))
    assert factory().history == []  # params are copied per episode, not shared
    assert env.step(" 3 ") == EnvStep(reward=1.0, done=True)


def test_factory_accepts_async_methods(user_module):
    env = environment_factory(f"{user_module}:AsyncGuess", {})()
    assert asyncio.run(env.step("1")).done


@pytest.mark.parametrize(
    ("attr", "params", "error", "match"),
    [
        ("Guess", {"secret": "seven"}, ValueError, "invalid params: secret must be an int"),
        ("Guess", {"sekret": 1}, ValueError, r"invalid params \['sekret'\].*secret, history"),
        ("NoStep", {}, ValueError, "NoStep has no step method"),
        ("Missing", {}, ValueError, "has no attribute 'Missing'"),
        ("NOT_A_CLASS", {}, ValueError, "is a int, not a class"),
        ("Broken", {}, RuntimeError, "building it failed: RuntimeError: database is down"),
    ],
)
def test_factory_errors_name_the_entrypoint(user_module, attr, params, error, match):
    with pytest.raises(error, match=match):
        environment_factory(f"{user_module}:{attr}", params)


def test_factory_missing_module_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'no_such_pkg\.envs:Game': cannot import module"):
        environment_factory("no_such_pkg.envs:Game", {})


def test_python_tool_without_the_sandbox_fails_at_start_not_in_process(monkeypatch):
    isolation._probe.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        check_environment("tool_calling", {"tools": ["python"]})  # admission does not need it
        with pytest.raises(SandboxUnavailable, match="tool 'python' needs the code sandbox"):
            environment_factory("tool_calling", {"tools": ["calculator", "python"]})
        environment_factory("tool_calling", {"tools": ["calculator"]})  # no sandbox needed
    finally:
        monkeypatch.undo()
        isolation._probe.cache_clear()


# ---------------------------------------------------------------- single_turn


def test_single_turn_is_todays_behaviour():
    env = environment_factory("single_turn", {})()
    assert isinstance(env, SingleTurn)
    assert env.reset(EpisodeItem(prompt="2+2?")) == [{"role": "user", "content": "2+2?"}]
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    messages = env.reset(EpisodeItem(prompt=prompt, answer="4"))
    assert messages == prompt
    messages[0]["content"] = "changed"
    assert prompt[0]["content"] == "Be brief."  # the row is not mutated
    assert env.step("4") == EnvStep(messages=[], reward=0.0, done=True, info={})


def test_the_docs_example_environment_works(tmp_path, monkeypatch):
    docs = (Path(__file__).parents[3] / "docs" / "environments.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", docs, re.DOTALL)
    (tmp_path / "docs_guess_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = environment_factory("docs_guess_env:Guess", {"penalty": 0.5})()
        assert env.reset(EpisodeItem(prompt="1-10?", answer="7")) == [
            {"role": "user", "content": "1-10?"}
        ]
        assert env.step("5") == EnvStep([{"role": "user", "content": "higher"}], reward=-0.5)
        assert env.step("no idea").reward == -0.5
        assert env.step("It is 7") == EnvStep(reward=1.0, done=True)
    finally:
        sys.modules.pop("docs_guess_env", None)
