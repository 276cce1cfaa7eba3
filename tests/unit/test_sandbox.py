"""The sandbox and the `python_tests` reward against hostile programs.

Every hostile run must end within its limits, score 0 with a reason, and leave the sandbox
working for the next program.
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
from lorarl.rewards.code_reward import IOCase, extract_code, load_tests
from lorarl.rewards.sandbox import (
    SandboxLimits,
    classify,
    network_namespace_available,
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
    program = (
        "import os\n"
        "name = input()\n"
        "open('note.txt', 'w').write(name)\n"
        "print(open('note.txt').read(), os.getcwd() == os.environ['HOME'], sorted(os.environ))\n"
    )
    run = run_python(program, limits=FAST, stdin="ada\n")
    assert run.status == "ok", run
    assert run.stdout.startswith("ada True ")
    assert "['HOME', 'LANG', 'PATH', 'TMPDIR']" in run.stdout  # nothing of ours leaks in
    assert not Path(run.stdout.split()[0]).exists()


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


def test_fork_bomb_is_refused():
    start = time.monotonic()
    run = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert run.status == "refused"
    assert run.refused == ["os.fork: not allowed"]
    assert time.monotonic() - start < 2
    assert_still_works()


@pytest.mark.parametrize(
    "program, event",
    [
        ("import subprocess\nsubprocess.run(['true'])", "import"),  # _posixsubprocess
        ("import os\nos.system('true')", "os.system"),
        ("import os\nos.execv('/bin/true', ['true'])", "os.exec"),
        ("import ctypes", "import"),
        ("import os, signal\nos.kill(1, signal.SIGTERM)", "os.kill"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "resource."),
    ],
)
def test_process_and_limit_escapes_are_refused(program, event):
    run = run_python(program, limits=FAST)
    assert run.status == "refused", run
    assert run.refused and run.refused[0].startswith(event)


def test_timeout_kills_the_whole_process_group_when_the_hook_is_off():
    # Without the hook, forks succeed (root ignores RLIMIT_NPROC); the group kill must still
    # take every child down with the parent.
    program = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        time.sleep(1000)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "print(*kids, flush=True)\n"
        "time.sleep(1000)\n"
    )
    limits = SandboxLimits(wall_seconds=1.5, cpu_seconds=5, audit_hook=False, max_processes=64)
    run = run_python(program, limits=limits)
    assert run.status == "timeout"
    kids = [int(p) for p in run.stdout.split()]
    assert len(kids) == 3
    time.sleep(0.2)
    for pid in kids:
        # a reaped zombie or a vanished pid are both dead; a live sleeper is a leak
        status = Path(f"/proc/{pid}/status")
        if status.exists():
            state = next(ln for ln in status.read_text().splitlines() if ln.startswith("State"))
            assert "Z" in state or "X" in state, f"child {pid} survived: {state}"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores RLIMIT_NPROC")
def test_rlimit_nproc_stops_fork_without_the_hook():
    limits = SandboxLimits(wall_seconds=3, cpu_seconds=2, audit_hook=False)
    run = run_python("import os\nos.fork()", limits=limits)
    assert run.status == "error"
    assert "BlockingIOError" in run.reason or "Resource temporarily unavailable" in run.reason


def test_ten_gigabyte_allocation_fails_fast():
    start = time.monotonic()
    run = run_python("x = bytearray(10 * 1024 ** 3)", limits=FAST)
    assert run.status == "memory"
    assert "address space limit" in run.reason
    assert time.monotonic() - start < 2
    assert_still_works()


def test_connecting_to_localhost_is_refused(listener):
    port, accepted = listener
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
    run = run_python(program, limits=FAST)
    assert run.status == "refused"
    assert run.refused[0].startswith("socket.")
    assert "no network" in run.reason
    time.sleep(0.3)
    assert accepted == []
    assert_still_works()


@pytest.mark.skipif(not network_namespace_available(), reason="no user/network namespaces here")
def test_network_namespace_alone_blocks_localhost(listener):
    port, accepted = listener
    program = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('failed', exc.errno)\n"
    )
    limits = SandboxLimits(wall_seconds=3, cpu_seconds=2, audit_hook=False, network_namespace=True)
    run = run_python(program, limits=limits)
    assert run.status == "ok", run
    assert run.stdout.startswith("failed")
    time.sleep(0.3)
    assert accepted == []


def test_writing_outside_the_temp_dir_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for program in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        "open('../escaped.txt', 'w').write('x')",
        f"import os\nos.symlink('/etc/passwd', {str(tmp_path / 'link')!r})",
        f"import os\nos.remove({str(tmp_path)!r} + '/keep.txt')",
    ):
        (tmp_path / "keep.txt").write_text("keep")
        run = run_python(program, limits=FAST)
        assert run.status == "refused", (program, run)
        assert "only inside the sandbox temp dir" in run.reason
        assert not target.exists() and (tmp_path / "keep.txt").read_text() == "keep"
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
        "wall-clock limit of 3 s exceeded; process group killed",
    )
    assert classify(1, False, "Traceback...\nValueError: boom\n", FAST) == (
        "error",
        "ValueError: boom",
    )
    assert classify(1, False, "x\nSandboxViolation: os.fork refused: not allowed", FAST)[0] == (
        "refused"
    )


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_seconds must be > 0"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="max_open_files must be >= 16"):
        SandboxLimits(max_open_files=3)


# ---------------------------------------------------------------- the python_tests reward


@pytest.fixture(scope="module")
def reward():
    import lorarl.rewards.code_reward  # noqa: F401  (registers python_tests)

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


def test_caught_refusal_still_scores_zero(reward):
    sneaky = (
        "import socket\n"
        "try:\n    socket.socket()\nexcept Exception:\n    pass\n"
        "def add(a, b):\n    return a + b\n"
    )
    result = reward("", sneaky, ADD_TESTS, {})
    assert result.score == 0.0
    assert result.info["reason"].startswith("refused by the sandbox: socket.")
    lenient = get_reward("python_tests", timeout_seconds=3, penalize_violations=False)
    assert lenient("", sneaky, ADD_TESTS, {}).score == 1.0


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
    import lorarl.rewards.code_reward  # noqa: F401

    with pytest.raises(ValueError, match="timeout_seconds must be a positive number"):
        get_reward("python_tests", timeout_seconds=0)
    with pytest.raises(ValueError, match="memory_mb must be an integer >= 32"):
        get_reward("python_tests", memory_mb=4)
