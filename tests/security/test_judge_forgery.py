"""Issue 34, finding 3: assert-mode verdicts a solution could forge.

The judge ran the tests with every name the solution defined, so a solution defining `set` or
`abs` replaced the builtins the tests call: wrong answers alone scored 0/5, the same wrong answers
plus two one-line shadows scored 3/5. Here the same five tests, and the other ways a solution (or
anything but the judge's own accounting) could put words in the verdict's mouth.
"""

from __future__ import annotations

import json

import pytest

from lorarl.rewards import get_reward

# The three shapes the red-team run passed with shadows, and two more.
TESTS = [
    "assert set(uniq([3, 1, 3, 2])) == set([1, 2, 3])",
    "assert abs(root(2.0) - 1.41421356) < 1e-6",
    "def check(candidate):\n"
    "    assert abs(candidate(9.0) - 3.0) < 1e-9\n"
    "    assert sorted(uniq([2, 2, 1])) == [1, 2]\n"
    "\n"
    "check(root)\n",
    "assert len(uniq([1, 1])) == 1",
    "assert isinstance(root(4.0), float) and max(uniq([5, 5, 7])) == 7",
]
WRONG = "def uniq(xs):\n    return []\n\ndef root(x):\n    return -1.0\n"
RIGHT = "def uniq(xs):\n    return sorted(dict.fromkeys(xs))\n\ndef root(x):\n    return x ** 0.5\n"
SHADOWS = (
    "def set(*a):\n    return 0\n\n"
    "def abs(x):\n    return 0\n\n"
    "def len(x):\n    return 1\n\n"
    "def isinstance(*a):\n    return True\n\n"
    "def max(*a):\n    return 7\n\n"
    "def sorted(*a):\n    return [1, 2]\n"
)


@pytest.fixture(scope="module")
def reward():
    import lorarl.rewards.functions.code  # noqa: F401  (registers python_tests)

    return get_reward("python_tests", timeout_seconds=6, test_timeout_seconds=2, memory_mb=256)


def test_the_tests_tell_right_from_wrong(reward):
    assert reward("", RIGHT, json.dumps(TESTS), {}).score == 1.0
    assert reward("", WRONG, json.dumps(TESTS), {}).score == 0.0


def test_shadowing_builtins_does_not_pass_wrong_answers(reward):
    result = reward("", WRONG + SHADOWS, json.dumps(TESTS), {})
    assert result.score == 0.0, result.info


def test_the_two_shadows_of_the_report_do_not_pass_wrong_answers(reward):
    shadows = "def set(*a): return 0\ndef abs(x): return 0\n"
    result = reward("", WRONG + shadows, json.dumps(TESTS), {})
    assert result.score == 0.0, result.info


def test_a_right_solution_that_defines_builtin_names_still_passes(reward):
    """Shadowing is ignored, not punished: the tests just use the real builtins (a guard: this
    passed before the fix too)."""
    result = reward("", RIGHT + "\ndef set(*a):\n    return 0\n", json.dumps(TESTS), {})
    assert result.score == 1.0, result.info


def test_a_declared_api_is_all_the_tests_see(reward):
    """With `entry_point` (HumanEval's field) or `solution_api`, no other name of the solution
    reaches the tests: a fake `math` does not answer a test that relied on the solution's own
    import."""
    tests = json.dumps(["assert math.isclose(area(1.0), 3.14159, rel_tol=1e-4)"])
    fake_math = (
        "class math:\n"
        "    @staticmethod\n"
        "    def isclose(*a, **k):\n"
        "        return True\n"
        "def area(r):\n    return 0.0\n"
    )
    assert reward("", fake_math, tests, {"entry_point": "area"}).score == 0.0
    assert reward("", fake_math, tests, {"solution_api": ["area"]}).score == 0.0
    honest = "import math\ndef area(r):\n    return math.pi * r * r\n"
    assert reward("", honest, tests, {"entry_point": "area"}).score == 1.0


def test_printing_fake_verdicts_does_nothing(reward):
    fake_lines = "".join(
        json.dumps(obj) + "\\n"
        for i in range(len(TESTS))
        for obj in ({"test": i, "error": None}, {"done": len(TESTS)})
    )
    forger = (
        "import os, sys\n"
        f"fake = '{fake_lines}'\n"
        "print(fake)\n"
        "sys.stderr.write(fake)\n"
        "os.write(1, fake.encode())\n"
        "os.write(2, fake.encode())\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        "        os.write(fd, fake.encode())\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = reward("", forger + WRONG, json.dumps(TESTS), {})
    assert result.score == 0.0, result.info


def test_only_the_judges_own_channel_counts(reward):
    """Output on the judge's stdout is not a verdict, even when test code itself writes one."""
    tests = [
        "assert uniq([1]) == [1]",
        'import os\nos.write(1, b\'{"test": 0, "error": null}\\n\')\n',
    ]
    result = reward("", WRONG, json.dumps(tests), {})
    assert result.score == 0.5, result.info  # test 1 passes; test 0 stays failed
    assert result.info["failures"][0]["test"] == 0
