"""Issue 34, findings 1, 2 and 5 (the sandbox parts): the sandbox as an unprivileged boundary.

Each test is a hostile program the way a completion would run it. They are written to run as
root (CI and `make test` here run as root, and that is where finding 1 is critical); as a non-root
caller they hold as well, the kernel uid then being the caller's own.

Nothing here changes the host: the `/proc/sys` checks open files for writing and close them
without writing a byte (and would fail the test if the open succeeded).
"""

from __future__ import annotations

import errno
import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from lorarl.rewards import get_reward
from lorarl.rewards.sandbox import isolation
from lorarl.rewards.sandbox.run import (
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    run_python,
)

MIB = 1024 * 1024
FAST = SandboxLimits(wall_seconds=6.0, cpu_seconds=4, memory_bytes=256 * MIB)
ADD_TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(-4, 4) == 0"])
ADD = "\ndef add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def reward():
    import lorarl.rewards.functions.code  # noqa: F401  (registers python_tests)

    return get_reward("python_tests", timeout_seconds=6, test_timeout_seconds=2, memory_mb=256)


def _lines(run) -> list[str]:
    assert run.status == "ok", run
    return run.stdout.splitlines()


# ------------------------------------------------------------- finding 1: the kernel uid


def test_the_program_runs_as_an_unprivileged_kernel_uid():
    """Inside its namespace the uid means nothing; what the kernel checks is the uid it maps to."""
    program = (
        "import os\n"
        "uid = os.getuid()\n"
        "for line in open('/proc/self/uid_map'):\n"
        "    inner, outer, count = map(int, line.split())\n"
        "    if inner <= uid < inner + count:\n"
        "        print('kernel uid', outer + uid - inner)\n"
        "print('resuid', sorted(set(os.getresuid())), 'resgid', sorted(set(os.getresgid())))\n"
        "print('groups', os.getgroups())\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "for cap in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb'):\n"
        "    print(cap, int(status[cap], 16))\n"
    )
    out = _lines(run_python(program, limits=FAST))
    kernel_uid = int(out[0].split()[-1])
    assert kernel_uid != 0, out
    if os.geteuid() == 0:
        assert kernel_uid == isolation.SANDBOX_UID, out
    assert out[1] == f"resuid [{isolation.SANDBOX_UID}] resgid [{isolation.SANDBOX_UID}]"
    assert out[2] in ("groups []", f"groups [{isolation.SANDBOX_UID}]")
    assert out[3:] == ["CapInh 0", "CapPrm 0", "CapEff 0", "CapAmb 0"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a caller whose uid is kernel uid 0")
def test_a_mapping_onto_kernel_uid_0_stops_before_any_untrusted_code(monkeypatch, tmp_path):
    """Force the old way (bubblewrap mapping 65534 onto the caller, root): the bootstrap refuses."""
    monkeypatch.setattr(isolation, "_as_root", lambda: False)
    marker = tmp_path / "ran"
    run = run_python(f"open({str(marker)!r}, 'w')", limits=FAST)  # would fail anyway; never runs
    assert run.returncode == 125, run
    assert "refusing to run untrusted code: uid 65534 maps to kernel uid 0" in run.stderr, run
    assert not marker.exists()


@pytest.mark.parametrize("path", ["/proc/sys/kernel/core_pattern", "/proc/sys/fs/lease-break-time"])
def test_global_kernel_knobs_cannot_be_opened_for_writing(path):
    """Writing core_pattern would run a program of the sandbox's choice as root on the host."""
    program = (
        "import os, sys\n"
        f"path = {path!r}\n"
        "print('readable', open(path).read().strip() != '')\n"
        "try:\n"
        "    fd = os.open(path, os.O_WRONLY)\n"
        "except OSError as exc:\n"
        "    print('refused', exc.errno)\n"
        "else:\n"
        "    os.close(fd)  # opened, never written: the test fails on this line's output\n"
        "    print('WRITABLE')\n"
    )
    out = _lines(run_python(program, limits=FAST))
    assert out[0] == "readable True"
    assert out[1] in (f"refused {errno.EACCES}", f"refused {errno.EROFS}", f"refused {errno.EPERM}")


def test_proc_sys_is_mounted_read_only_in_the_sandbox():
    """Read-only on top of the uid: neither alone is relied on."""
    program = (
        "best = None\n"
        "for line in open('/proc/self/mountinfo'):\n"
        "    f = line.split()\n"
        "    point, opts = f[4], f[5].split(',')\n"
        "    if '/proc/sys/'.startswith(point.rstrip('/') + '/'):\n"
        "        if best is None or len(point) > len(best[0]):\n"
        "            best = (point, opts)\n"
        "print(best[0], 'ro' in best[1])\n"
    )
    out = _lines(run_python(program, limits=FAST))
    assert out[0].split()[1] == "True", out


def test_a_completion_probing_proc_sys_scores_zero_and_changes_nothing(reward):
    knob = Path("/proc/sys/fs/lease-break-time")
    before = knob.read_text()
    body = "import os\nfd = os.open('/proc/sys/fs/lease-break-time', os.O_WRONLY)\nos.close(fd)\n"
    result = reward("", f"```python\n{body}{ADD}```", ADD_TESTS, {})
    assert result.score == 0.0, result.info
    assert knob.read_text() == before


# ------------------------------------------------------------- finding 2: /dev and /dev/shm


def _host_shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    raise AssertionError("no Shmem line in /proc/meminfo")


FILL_SHM = r"""
import errno, os, sys, time
chunk = b"\xa5" * (4 * 1024 * 1024)
total, why, t0 = 0, "wrote it all", time.monotonic()
try:
    for i in range(256):  # 1 GiB in files of 4 MiB (each under the file-size rlimit)
        with open("/dev/shm/fill-%d" % i, "wb") as f:
            f.write(chunk)
        total += len(chunk)
except OSError as exc:
    why = errno.errorcode.get(exc.errno, str(exc.errno))
print(total, why, round(time.monotonic() - t0, 2))
sys.stdout.flush()
time.sleep(1.0)  # hold what was written while the host measures
"""


def test_filling_dev_shm_stops_at_its_cap_and_the_host_does_not_grow():
    limits = SandboxLimits(wall_seconds=20, cpu_seconds=15, memory_bytes=256 * MIB)
    base = _host_shmem_kib()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _host_shmem_kib())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run = Sandbox(FILL_SHM, limits=limits).wait()
    finally:
        done.set()
        sampler.join()
    total, why, _secs = _lines(run)[0].split()
    cap = limits.shm_bytes
    assert why == "ENOSPC", run.stdout
    assert int(total) <= cap, (int(total), cap)
    grown_mib = (peak[0] - base) / 1024
    # Other work on the host moves Shmem a little; the attack moved it by 1,024 MiB.
    assert grown_mib < cap / MIB + 32, f"host shared memory grew by {grown_mib:.0f} MiB"


def test_dev_is_minimal_and_read_only():
    program = (
        "import os\n"
        "print(sorted(os.listdir('/dev')))\n"
        "for path in ('/dev/evil', '/dev/null.d'):\n"
        "    try:\n"
        "        open(path, 'w')\n"
        "    except OSError as exc:\n"
        "        print('refused', exc.errno)\n"
        "    else:\n"
        "        print('CREATED', path)\n"
        "with open('/dev/null', 'w') as f:\n"
        "    f.write('x')\n"
        "print(len(open('/dev/urandom', 'rb').read(8)), open('/dev/zero', 'rb').read(2))\n"
    )
    out = _lines(run_python(program, limits=FAST))
    names = set(eval(out[0]))  # a list of str printed by the sandbox; nothing else is eval'ed
    assert {"null", "zero", "random", "urandom", "shm"} <= names
    assert not names & {"vsock", "kvm", "mem", "kmsg", "vda", "sda", "fuse", "net"}
    assert out[1:3] == [f"refused {errno.EROFS}"] * 2
    assert out[3] == "8 b'\\x00\\x00'"


# ------------------------------------------------------------- finding 5: threads and sockets


THREADS = r"""
import threading, time
threading.stack_size(64 * 1024)  # small stacks: the address-space limit is not what stops it
stop = threading.Event()
started, why, t0 = 0, "all started", time.monotonic()
try:
    for _ in range(600):
        threading.Thread(target=stop.wait, daemon=True).start()
        started += 1
except Exception as exc:
    why = type(exc).__name__
print(started, why, round(time.monotonic() - t0, 3))
stop.set()
"""


def test_hundreds_of_threads_fail_early():
    run = run_python(THREADS, limits=FAST)
    started, why, _ = _lines(run)[0].split()
    assert why == "RuntimeError", run.stdout  # "can't start new thread"
    assert int(started) < FAST.max_threads, run.stdout


def test_processes_count_against_the_same_cap_when_forking_is_allowed():
    program = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "except OSError as exc:\n"
        "    print(n, exc.errno)\n"
    )
    limits = SandboxLimits(wall_seconds=6, cpu_seconds=2, max_processes=4, max_threads=4)
    out = _lines(run_python(program, limits=limits))
    n, err = map(int, out[0].split())
    assert err == errno.EAGAIN and n < 4 + 4, out


SOCKETS = r"""
import errno, socket
for name, family, kind in [
    ("AF_VSOCK", 40, socket.SOCK_STREAM),
    ("AF_INET", socket.AF_INET, socket.SOCK_STREAM),
    ("AF_INET6", socket.AF_INET6, socket.SOCK_DGRAM),
    ("AF_NETLINK", 16, socket.SOCK_RAW),
    ("AF_PACKET", 17, socket.SOCK_RAW),
]:
    try:
        socket.socket(family, kind).close()
        print(name, "OPENED")
    except OSError as exc:
        print(name, errno.errorcode.get(exc.errno, exc.errno))
a, b = socket.socketpair()  # AF_UNIX stays: multiprocessing and friends use it
a.sendall(b"ok")
print("AF_UNIX", b.recv(2).decode())
"""


def test_only_unix_sockets_can_be_created():
    out = _lines(run_python(SOCKETS, limits=FAST))
    by_family = dict(line.split() for line in out)
    for family in ("AF_VSOCK", "AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET"):
        assert by_family[family] in ("EPERM", "EAFNOSUPPORT"), out
    assert by_family["AF_UNIX"] == "ok"


def test_the_filter_refuses_other_families_whatever_the_upper_bits():
    """The domain is an int: a 64-bit value whose low half is AF_VSOCK must not slip through."""
    program = (
        "import ctypes, ctypes.util\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.syscall.restype = ctypes.c_long\n"
        "for domain in (40, (1 << 32) | 40, (1 << 32) | 1):\n"
        "    r = libc.syscall(41, ctypes.c_long(domain), 1, 0)  # x86_64 socket(2)\n"
        "    print(domain, r >= 0, ctypes.get_errno())\n"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("syscall number 41 is socket(2) on x86_64 only")
    out = _lines(run_python(program, limits=FAST))
    assert [line.split()[1] for line in out] == ["False", "False", "False"], out


def test_an_unknown_architecture_fails_closed(monkeypatch):
    isolation.seccomp_filter.cache_clear()
    monkeypatch.setattr(isolation, "_machine", lambda: "mips")
    try:
        with pytest.raises(SandboxUnavailable, match="mips"):
            isolation.seccomp_filter(False)
    finally:
        monkeypatch.undo()
        isolation.seccomp_filter.cache_clear()


def test_limits_name_the_new_caps():
    assert re.search(r"shm_bytes must be > 0", _error(lambda: SandboxLimits(shm_bytes=0)))
    assert re.search(r"max_threads must be >= 1", _error(lambda: SandboxLimits(max_threads=0)))


def _error(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    return str(info.value)
