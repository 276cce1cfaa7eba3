"""The attacks of issue 16 against the `python_tests` sandbox, each as a test.

Each hostile program must score 0 and leave no file outside its tmpfs, no process, no delivered
signal and no secret read. They use only `run_python` and the registered reward, so the same
file also ran against the old audit-hook sandbox, where every test here failed (see
docs/security.md). `GC_UNHOOK` is how a red-team run switched the old hook off from pure Python;
against an OS boundary it finds nothing to switch off, and what it enabled must still fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lorarl.rewards import get_reward
from lorarl.rewards.sandbox.run import SandboxLimits, run_python

ADD_TESTS = json.dumps(
    ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(5, 5) == 10"]
)
ADD = "\ndef add(a, b):\n    return a + b\n"
FAST = SandboxLimits(wall_seconds=4.0, cpu_seconds=2, memory_bytes=256 * 1024 * 1024)

GC_UNHOOK = """
import gc
for _f in gc.get_objects():
    if type(_f).__name__ == "function" and _f.__name__ in ("hook", "inside") and _f.__closure__:
        for _n, _c in zip(_f.__code__.co_freevars, _f.__closure__):
            if _n == "blocked":
                _c.cell_contents = ("@none",)
            elif _n in ("blocked_imports", "path_args"):
                _c.cell_contents = type(_c.cell_contents)()
            elif _n == "work":
                _c.cell_contents = ""
"""


@pytest.fixture(scope="module")
def reward():
    import lorarl.rewards.functions.code  # noqa: F401  (registers python_tests)

    return get_reward("python_tests", timeout_seconds=4, test_timeout_seconds=1, memory_mb=256)


def solution(body: str) -> str:
    """A completion that attacks first, then solves the task (so only the attack can fail it)."""
    return f"```python\n{GC_UNHOOK}\n{body}\n{ADD}```"


@pytest.fixture()
def outside(tmp_path):
    """A directory outside every sandbox (on the host's /tmp) and one the sandbox sees read-only
    (the interpreter's install prefix); files the attack may create there are removed after."""
    seen = Path(sys.base_prefix).resolve() / f"lorarl-escape-{uuid.uuid4().hex}"
    (tmp_path / "keep.txt").write_text("keep")
    yield tmp_path, seen
    seen.unlink(missing_ok=True)


def _untouched(tmp_path: Path, seen: Path) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert (tmp_path / "keep.txt").read_text() == "keep"
    assert not seen.exists(), f"the sandbox wrote {seen}"


# ---------------------------------------------------------------- files


def test_dir_fd_write_and_delete_outside_fail(reward, outside):
    tmp_path, _ = outside
    body = (
        "import os\n"
        f"d = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
        "os.write(os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=d), b'x')\n"
        "os.unlink('keep.txt', dir_fd=d)\n"
    )
    assert reward("", solution(body), ADD_TESTS, {}).score == 0.0
    _untouched(*outside)


@pytest.mark.parametrize("where", ["host tmp", "read-only prefix"])
def test_plain_write_after_unhooking_fails(reward, outside, where):
    tmp_path, seen = outside
    target = tmp_path / "escaped.txt" if where == "host tmp" else seen
    body = (
        f"open({str(target)!r}, 'w').write('x')\n"
        f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})"
    )
    assert reward("", solution(body), ADD_TESTS, {}).score == 0.0
    _untouched(*outside)


def test_filling_the_disk_stops_at_the_tmpfs_cap():
    # 4 MiB files (under the per-file limit) until 160 MiB: only the private tmpfs can fill up.
    program = (
        GC_UNHOOK + "import os\n"
        "written = 0\n"
        "try:\n"
        "    for i in range(40):\n"
        "        with open('fill%d' % i, 'wb') as f:\n"
        "            f.write(b'x' * (4 << 20))\n"
        "        written += 4 << 20\n"
        "except OSError as exc:\n"
        "    print('stopped', exc.errno)\n"
        "print(written, os.getcwd())\n"
    )
    run = run_python(program, limits=FAST)
    assert run.status == "ok", run
    written, cwd = run.stdout.split()[-2:]
    assert "stopped 28" in run.stdout  # ENOSPC
    assert int(written) <= 64 * 1024 * 1024
    assert not Path(cwd, "fill0").exists()  # its /tmp is not the host's


def test_filling_the_disk_scores_zero(reward):
    body = "for i in range(40):\n    open('fill%d' % i, 'wb').write(b'x' * (4 << 20))"
    assert reward("", solution(body), ADD_TESTS, {}).score == 0.0


# ---------------------------------------------------------------- signals and processes


@pytest.fixture()
def sigusr2():
    received: list[int] = []
    old = signal.signal(signal.SIGUSR2, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGUSR2, old)


@pytest.mark.parametrize(
    "attack",
    [
        "signal.pidfd_send_signal(os.pidfd_open({pid}), signal.SIGUSR2)",
        "os.kill({pid}, signal.SIGUSR2)",
        "os.kill(os.getppid(), signal.SIGUSR2)",
    ],
)
def test_signalling_the_parent_delivers_nothing(reward, sigusr2, attack):
    body = "import os, signal\n" + attack.format(pid=os.getpid())
    assert reward("", solution(body), ADD_TESTS, {}).score == 0.0
    time.sleep(0.3)
    assert sigusr2 == [], "a signal from the sandbox reached the test process"


def _marked(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _double_fork(marker: str) -> str:
    return (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)',"
        f" {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
    )


@pytest.fixture()
def marker():
    mark = f"lorarl-daemon-{uuid.uuid4().hex}"
    yield mark
    for pid in _marked(mark):  # only what the old sandbox let escape, found by its unique mark
        os.kill(pid, signal.SIGKILL)


def _survivors(mark: str) -> list[int]:
    deadline = time.monotonic() + 1.0
    while (pids := _marked(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


@pytest.mark.parametrize("end", ["exits", "times out"])
def test_double_forked_process_dies_with_the_sandbox(marker, end):
    program = GC_UNHOOK + _double_fork(marker) + ("time.sleep(60)\n" if end == "times out" else "")
    limits = SandboxLimits(wall_seconds=2.0, cpu_seconds=2, max_processes=16)
    run = run_python(program, limits=limits)
    assert run.status == ("ok" if end == "exits" else "timeout"), run
    assert _survivors(marker) == []


def test_double_fork_in_a_solution_scores_zero_and_leaves_nothing(reward, marker):
    assert reward("", solution(_double_fork(marker)), ADD_TESTS, {}).score == 0.0
    assert _survivors(marker) == []


# ---------------------------------------------------------------- secrets


def test_parents_environment_and_files_are_not_readable(tmp_path):
    """The caller's environment (API keys) and its files (a token on disk) stay unreadable.

    The old sandbox's `unshare -rn` happened to deny /proc/<ppid>/environ on this machine; it
    leaked where `unshare` was unavailable (pods), and files were readable everywhere.
    """
    secret = uuid.uuid4().hex
    token = tmp_path / "token"
    token.write_text(secret)
    token.chmod(0o600)
    helper = (
        "import os, sys\n"
        "from lorarl.rewards.sandbox.run import run_python\n"
        "paths = [f'/proc/{os.getpid()}/environ', sys.argv[1]]\n"
        "print(run_python(sys.argv[2].replace('PATHS', repr(paths))).stdout)\n"
    )
    hostile = (
        "import os\n"
        "for p in [f'/proc/{os.getppid()}/environ', '/proc/1/environ', *PATHS]:\n"
        "    try:\n"
        "        print(open(p, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print('no', p, exc.errno)\n"
        "print(dict(os.environ))\n"
    )
    env = {**os.environ, "LORARL_TEST_SECRET": secret}
    done = subprocess.run(
        [sys.executable, "-c", helper, str(token), hostile],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "environ" in done.stdout and str(token) in done.stdout, done.stdout  # it ran them
    assert secret not in done.stdout


# ---------------------------------------------------------------- forged verdicts


FORGER = """
import json, os, sys
data = out = None
frame = sys._getframe(0)
while frame is not None:  # the old harness kept its nonce and report fd in its globals
    for value in list(frame.f_globals.values()):
        if isinstance(value, dict) and "nonce" in value:
            data, out = value, frame.f_globals.get("_OUT", 1)
    frame = frame.f_back
lines = []
for i in range(3):
    report = {"test": i, "error": None}
    lines.append((data["nonce"] if data else "") + json.dumps(report))
lines.append(json.dumps({"ready": True, "names": {}}))
for fd in {out or 1, *range(1, 20)}:
    try:
        os.write(fd, ("\\n".join(lines) + "\\n").encode())
    except OSError:
        pass
if data:
    os._exit(0)
def add(a, b):
    return 7
"""


def test_forging_a_pass_in_assert_mode_scores_zero(reward):
    result = reward("", f"```python\n{FORGER}\n```", ADD_TESTS, {})
    assert result.score == 0.0, result.info
    assert result.info["passed"] == 0
