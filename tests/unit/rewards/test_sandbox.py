"""The sandbox and the `python_tests` reward against hostile programs.

Every hostile run must end within its limits, score 0 with a reason, and leave the sandbox
working for the next program. The attacks of issue 16 are in tests/security.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from lorarl.rewards import get_reward
from lorarl.rewards.functions.code import IOCase, extract_code, load_tests
from lorarl.rewards.sandbox import isolation
from lorarl.rewards.sandbox.run import (
    SandboxLimits,
    SandboxUnavailable,
    classify,
    run_python,
)

FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=1, memory_bytes=256 * 1024 * 1024)
ADD_TESTS = json.dumps(
    ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(5, 5) == 10"]
)
GOOD = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."


def assert_still_works() -> None:
    run = run_python("print(6 * 7)", limits=FAST)
    assert run.status == "ok", run
    assert run.stdout == "42\n"


@pytest.fixture()
def listener():
    """A real TCP server on 127.0.0.1 that records whether anyone connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(conn)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join()
    srv.close()


# ---------------------------------------------------------------- the sandbox itself


def test_runs_a_program_with_stdin_in_a_fresh_temp_dir():
    name = f"note-{os.getpid()}-{time.monotonic_ns()}.txt"
    program = (
        "import os\n"
        "who = input()\n"
        f"open({name!r}, 'w').write(who)\n"
        f"print(open({name!r}).read(), os.getcwd(), os.environ['HOME'], sorted(os.environ))\n"
    )
    run = run_python(program, limits=FAST, stdin="ada\n")
    assert run.status == "ok", run
    assert run.stdout.startswith("ada /tmp /tmp ")
    assert "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']" in run.stdout  # nothing of ours leaks in
    assert not Path("/tmp", name).exists()  # its /tmp is a private tmpfs


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    start = time.monotonic()
    run = run_python("while True:\n    pass", limits=FAST)
    assert run.status == "cpu_limit"
    assert "CPU time limit of 1 s" in run.reason
    assert time.monotonic() - start < FAST.wall_seconds + 1
    assert_still_works()


def test_sleeping_forever_hits_the_wall_clock_timeout():
    limits = SandboxLimits(wall_seconds=1.0, cpu_seconds=5)
    start = time.monotonic()
    run = run_python("import time\ntime.sleep(1000)", limits=limits)
    assert run.status == "timeout"
    assert run.returncode is None
    assert "wall-clock limit of 1 s" in run.reason
    assert time.monotonic() - start < 2.5
    assert_still_works()


def test_fork_bomb_fails_at_the_first_fork():
    start = time.monotonic()
    run = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert run.status == "error"
    assert run.reason == "PermissionError: [Errno 1] Operation not permitted"
    assert time.monotonic() - start < 2
    assert_still_works()


def test_threads_still_work():
    program = (
        "import threading\n"
        "out = []\n"
        "t = threading.Thread(target=out.append, args=(42,))\n"
        "t.start(); t.join(); print(out)\n"
    )
    run = run_python(program, limits=FAST)
    assert run.status == "ok" and run.stdout == "[42]\n", run


@pytest.mark.parametrize(
    "program",
    [
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nassert os.system('true') == 0",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
        "import os, signal\nos.kill(1, signal.SIGTERM)",
        "import os\nos.pidfd_open(1)",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))",
    ],
)
def test_process_and_limit_escapes_fail(program):
    run = run_python(program, limits=FAST)
    assert run.status == "error", run
    assert (
        ("PermissionError" in run.reason)
        or ("ValueError" in run.reason)
        or ("AssertionError" in run.reason)
    ), run.reason


def test_seccomp_filter_refuses_calls_that_would_otherwise_succeed():
    # ptrace(PTRACE_TRACEME) and unshare(0) succeed in any unfiltered process.
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for call in (lambda: libc.ptrace(0, 0, 0, 0), lambda: libc.unshare(0)):\n"
        "    print(call(), ctypes.get_errno())\n"
        "print([l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0].split())\n"
    )
    run = run_python(program, limits=FAST)
    assert run.status == "ok", run
    assert run.stdout.splitlines() == ["-1 1", "-1 1", "['Seccomp:', '2']"]  # EPERM, filtered


def test_rlimit_nproc_bounds_forks_when_they_are_allowed():
    # Also as root: the program's kernel uid is never 0 (issue 34), so the kernel applies it.
    program = (
        "import os, time\n"
        "for i in range(32):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(5)\n"
        "        os._exit(0)\n"
    )
    limits = SandboxLimits(wall_seconds=3, cpu_seconds=2, max_processes=4, max_threads=2)
    run = run_python(program, limits=limits)
    assert run.status == "error"
    assert "BlockingIOError" in run.reason or "Resource temporarily unavailable" in run.reason


def test_ten_gigabyte_allocation_fails_fast():
    start = time.monotonic()
    run = run_python("x = bytearray(10 * 1024 ** 3)", limits=FAST)
    assert run.status == "memory"
    assert "address space limit" in run.reason
    assert time.monotonic() - start < 2
    assert_still_works()


def test_connecting_to_localhost_fails(listener):
    port, accepted = listener
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
    run = run_python(program, limits=FAST)
    assert run.status == "error"
    assert "OSError" in run.reason or "ConnectionRefusedError" in run.reason, run.reason
    time.sleep(0.3)
    assert accepted == []
    assert_still_works()


def test_the_root_is_read_only_and_the_callers_files_are_not_there(tmp_path):
    (tmp_path / "keep.txt").write_text("keep")
    for program in (
        f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('x')",
        f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})",
        "open('/usr/escaped.txt', 'w').write('x')",
        "import os\nos.symlink('/etc/passwd', '/etc/link')",
    ):
        run = run_python(program, limits=FAST)
        assert run.status == "error", (program, run)
        assert any(
            why in run.reason
            for why in ("Read-only file system", "No such file", "Permission denied")
        ), run.reason
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert not Path("/usr/escaped.txt").exists()
    assert_still_works()


def test_runaway_output_is_capped():
    limits = SandboxLimits(wall_seconds=3, cpu_seconds=2, max_file_bytes=64 * 1024)
    run = run_python("while True:\n    print('x' * 1000)", limits=limits)
    assert run.status == "file_limit"
    assert len(run.stdout) <= 64 * 1024 + 100


def test_classify_names_each_limit():
    assert classify(-signal.SIGXCPU, False, "", FAST)[0] == "cpu_limit"
    assert classify(-signal.SIGKILL, False, "", FAST)[0] == "killed"
    assert classify(None, True, "", FAST) == (
        "timeout",
        "wall-clock limit of 3 s exceeded; sandbox killed",
    )
    assert classify(128 + signal.SIGXCPU, False, "", FAST)[0] == "cpu_limit"  # as bwrap says it
    assert classify(1, False, "Traceback...\nValueError: boom\n", FAST) == (
        "error",
        "ValueError: boom",
    )


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_seconds must be > 0"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="max_open_files must be >= 16"):
        SandboxLimits(max_open_files=3)
    with pytest.raises(ValueError, match="tmpfs_bytes must be > 0"):
        SandboxLimits(tmpfs_bytes=0)


def test_no_sandbox_means_a_loud_error_not_a_weaker_one(monkeypatch):
    import lorarl.rewards.functions.code  # noqa: F401

    isolation._probe.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        with pytest.raises(SandboxUnavailable, match="runtimeClassName: gvisor"):
            run_python("print(1)", limits=FAST)
        with pytest.raises(SandboxUnavailable, match="never falls back"):
            get_reward("python_tests")("", GOOD, ADD_TESTS, {})
    finally:
        monkeypatch.undo()
        isolation._probe.cache_clear()
    assert_still_works()


# ---------------------------------------------------------------- the python_tests reward


@pytest.fixture(scope="module")
def reward():
    import lorarl.rewards.functions.code  # noqa: F401  (registers python_tests)

    return get_reward("python_tests", timeout_seconds=3, test_timeout_seconds=1, memory_mb=256)


def test_correct_solution_scores_one(reward):
    result = reward("Write add.", GOOD, ADD_TESTS, {})
    assert result.score == 1.0
    assert result.info["passed"] == 3 and result.info["total"] == 3
    assert result.info["failures"] == []


def test_partly_correct_solution_scores_the_pass_fraction(reward):
    result = reward("", "def add(a, b):\n    return 10", ADD_TESTS, {})
    assert result.score == pytest.approx(1 / 3)  # only add(5, 5) == 10 passes
    assert [f["test"] for f in result.info["failures"]] == [0, 1]


HOSTILE = {
    "infinite loop": "def add(a, b):\n    while True:\n        pass",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "10 GB allocation": "blob = bytearray(10 * 1024 ** 3)\ndef add(a, b):\n    return a + b",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
    "write outside": "open('/tmp/lorarl-sandbox-escape.txt', 'w').write('x')",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_solution_scores_zero_with_a_reason(reward, name):
    start = time.monotonic()
    result = reward("", f"```python\n{HOSTILE[name]}\n```", ADD_TESTS, {})
    assert result.score == 0.0
    assert result.info["reason"]
    assert time.monotonic() - start < 3 + 1.5  # within timeout_seconds
    assert reward("", GOOD, ADD_TESTS, {}).score == 1.0  # and the next sample is fine


def test_solution_objects_are_reached_through_proxies(reward):
    solution = (
        "import math\n"
        "SCALE = 2\n"
        "class Acc:\n"
        "    def __init__(self):\n"
        "        self.items = []\n"
        "    def add(self, x):\n"
        "        self.items.append(x)\n"
        "        return self\n"
        "    def total(self):\n"
        "        return {'sum': sum(self.items) * SCALE, 'seen': set(self.items), 'n': (1,)}\n"
    )
    tests = json.dumps(
        [
            "a = Acc()\nassert a.add(1).add(2).total() == {'sum': 6, 'seen': {1, 2}, 'n': (1,)}",
            "assert SCALE == 2 and math.floor(2.5) == 2",
            "assert Acc().total()['seen'] == set()",
        ]
    )
    result = reward("", solution, tests, {})
    assert result.score == 1.0, result.info


def test_a_solution_that_fails_to_load_fails_every_test(reward):
    result = reward("", "raise ValueError('nope')", ADD_TESTS, {})
    assert result.score == 0.0
    assert result.info["reason"] == "solution failed: ValueError: nope"
    assert [f["error"] for f in result.info["failures"]] == ["ValueError: nope"] * 3


def test_exiting_early_does_not_pass(reward):
    result = reward("", "import os\nos._exit(0)", ADD_TESTS, {})
    assert result.score == 0.0


def test_printing_a_fake_report_does_not_pass(reward):
    forger = (
        "import os\n"
        "for i in range(3):\n"
        "    os.write(1, ('@@' + 'f' * 32 + '@@{\"test\": %d, \"error\": null}\\n' % i).encode())\n"
        "def add(a, b):\n    return 0\n"
    )
    assert reward("", forger, ADD_TESTS, {}).score == pytest.approx(1 / 3)  # add(-4, 4) == 0


def test_stdin_stdout_cases_are_judged_outside_the_sandbox(reward):
    cases = json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]})
    good = "a, b = map(int, input().split())\nprint(a + b)"
    assert reward("", good, cases, {}).score == 1.0
    wrong = reward("", "a, b = map(int, input().split())\nprint(a * b)", cases, {})
    assert wrong.score == 0.0
    assert wrong.info["failures"][0]["error"] == "wrong output: '2\\n'"


def test_tests_from_metadata_win_over_ground_truth(reward):
    meta = {"tests": ["assert add(2, 2) == 4"]}
    result = reward("", GOOD, "not json and not valid python (", meta)
    assert result.score == 1.0 and result.info["total"] == 1


def test_load_tests_formats_and_errors():
    assert load_tests("assert f() == 1", {}).asserts == ("assert f() == 1",)
    io = load_tests(json.dumps([{"input": ["1", "2"], "output": 3}]), {})
    assert io.io == (IOCase(stdin="1\n2\n", stdout="3"),)
    with pytest.raises(ValueError, match=r"metadata\['tests'\] or the ground truth"):
        load_tests(None, {})
    with pytest.raises(ValueError, match=r"ground truth\[1\]: expected an \{input, output\}"):
        load_tests(json.dumps([{"input": "1", "output": "1"}, {"input": "2"}]), {})
    with pytest.raises(ValueError, match="mixes assert strings and input/output cases"):
        load_tests(json.dumps(["assert True", {"input": "1", "output": "1"}]), {})
    with pytest.raises(ValueError, match="equal length"):
        load_tests(json.dumps({"inputs": ["1"], "outputs": []}), {})


def test_extract_code_takes_the_last_fenced_block():
    text = "```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_bad_params_fail_at_bind_time():
    import lorarl.rewards.functions.code  # noqa: F401

    with pytest.raises(ValueError, match="timeout_seconds must be a positive number"):
        get_reward("python_tests", timeout_seconds=0)
    with pytest.raises(ValueError, match="memory_mb must be an integer >= 32"):
        get_reward("python_tests", memory_mb=4)


def test_concurrent_samples_are_judged_by_their_own_judge(reward):
    from concurrent.futures import ThreadPoolExecutor

    wrong = "def add(a, b):\n    return 0"
    with ThreadPoolExecutor(6) as pool:
        scores = list(
            pool.map(lambda i: reward("", GOOD if i % 2 else wrong, ADD_TESTS, {}).score, range(12))
        )
    assert scores == [1 / 3, 1.0] * 6  # add(-4, 4) == 0 is the one test `wrong` passes


def test_humaneval_style_check_function_gets_the_solution_as_a_proxy(reward):
    tests = "def check(candidate):\n    assert candidate(1, 2) == 3\n\ncheck(add)\n"
    assert reward("", GOOD, tests, {}).score == 1.0
    assert reward("", "def add(a, b):\n    return a * b", tests, {}).score == 0.0
