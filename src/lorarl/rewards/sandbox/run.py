"""Run untrusted Python (model completions) in a fresh process behind an OS boundary.

The boundary itself (namespaces, a read-only root with a private size-capped tmpfs, seccomp,
the caller's environment cleared) is built in `isolation.py` with bubblewrap. This module adds the
per-run limits and the bookkeeping:

- the bootstrap first drops to the sandbox's unprivileged uid (`isolation.DROP_PRIVILEGES`), then
  sets rlimits on itself before any untrusted code runs (hard = soft, so the code cannot raise
  them back): CPU seconds (SIGXCPU), address space (big allocations raise MemoryError), file size
  (SIGXFSZ / EFBIG), open files, no core dumps, and tasks (RLIMIT_NPROC: threads and processes
  together, `max_threads + max_processes`). The kernel counts RLIMIT_NPROC per user namespace and
  kernel uid, so the count is this sandbox's own, and it applies because that uid is never 0;
- process creation is off by default (seccomp makes fork/vfork/clone fail with EPERM; threads
  still work, up to the cap). `max_processes > 0` allows forking, bounded by the same cap;
- the wall-clock timeout SIGKILLs the pid namespace's init, and the kernel then kills every
  process in the namespace, double-forked daemons included, before `run_python` returns;
- stdout/stderr go to files outside the sandbox, bounded by the file size limit and truncated to
  `max_output_bytes`;
- a sandbox started while a `CancelScope` is active (the reward service's request) attaches to it:
  cancelling the scope SIGKILLs the namespace at once (`cancel()`), and no sandbox starts in a
  scope that is already cancelled (`ScoringCancelled`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorarl.rewards.sandbox.cancel import ScoringCancelled, current_scope
from lorarl.rewards.sandbox.isolation import (
    DROP_PRIVILEGES,
    SandboxUnavailable,
    check_available,
    interpreter,
    launch,
    seccomp_filter,
)

__all__ = [
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "ScoringCancelled",
    "Status",
    "check_available",
    "classify",
    "run_python",
]

Status = Literal["ok", "error", "memory", "timeout", "cpu_limit", "file_limit", "killed"]

_MIB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one run; defaults suit scoring a short solution against a few tests."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 512 * _MIB
    max_processes: int = 0  # 0: fork/clone of processes fails (EPERM); threads still work
    max_threads: int = 32  # threads of the program, the main one included (RLIMIT_NPROC)
    max_file_bytes: int = 8 * _MIB
    max_open_files: int = 64
    max_output_bytes: int = 1 * _MIB
    tmpfs_bytes: int = 64 * _MIB  # /tmp, writable, in memory outside the address-space limit
    shm_bytes: int = 16 * _MIB  # /dev/shm, the same; the other writable place
    temp_root: str | None = None  # where stdout/stderr files are kept (outside the sandbox)

    def __post_init__(self) -> None:
        for name in (
            "wall_seconds",
            "cpu_seconds",
            "memory_bytes",
            "max_file_bytes",
            "tmpfs_bytes",
            "shm_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0 (got {getattr(self, name)})")
        if self.max_open_files < 16:
            raise ValueError(
                f"SandboxLimits.max_open_files must be >= 16 (got {self.max_open_files}): "
                "the interpreter itself needs a few"
            )
        if self.max_threads < 1:
            raise ValueError(f"SandboxLimits.max_threads must be >= 1 (got {self.max_threads})")
        if self.max_processes < 0:
            raise ValueError(f"SandboxLimits.max_processes must be >= 0 (got {self.max_processes})")


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    reason: str

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# The interpreter's first code inside the sandbox: drop to the unprivileged uid, lower its own
# limits, then run the program.
# Kept as source (run with `-c`) so nothing importable from lorarl is needed in there.
_BOOTSTRAP = (
    DROP_PRIVILEGES
    + r"""
import io, json, os, resource, sys
_cfg = json.loads(sys.argv[1])
_payload = json.loads(sys.stdin.read())
_fd = os.open(os.devnull, os.O_RDONLY)
os.dup2(_fd, 0)
os.close(_fd)
sys.stdin = io.StringIO(_payload["stdin"])
for _name, _soft, _hard in _cfg["rlimits"]:
    _res = getattr(resource, _name)
    _cap = resource.getrlimit(_res)[1]
    if _cap != resource.RLIM_INFINITY:
        _soft, _hard = min(_soft, _cap), min(_hard, _cap)
    resource.setrlimit(_res, (_soft, _hard))
sys.argv = ["<sandbox>", *_cfg["args"]]
_program = _payload["program"]
del _cfg, _payload, _fd, _name, _soft, _hard, _cap, _res
exec(compile(_program, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""
)


class Sandbox:
    """One program running in its own sandbox; `wait()` returns its result and leaves nothing.

    `pass_fds` are the caller's descriptors the program may use (pipes to another sandbox);
    they keep their numbers and the program gets them as `sys.argv[1:]`. Started under an active
    `CancelScope` (`lorarl.rewards.sandbox.cancel`), it is killed when that scope is cancelled, and
    it
    refuses to start (`ScoringCancelled`) in one that already is.
    """

    def __init__(
        self,
        program: str,
        *,
        limits: SandboxLimits | None = None,
        stdin: str = "",
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self._scope = current_scope()
        if self._scope is not None:
            self._scope.check()  # a cancelled request starts nothing more
        check_available()
        self.limits = limits or SandboxLimits()
        self._root = Path(tempfile.mkdtemp(prefix="lorarl-sbx-", dir=self.limits.temp_root))
        self._init_pidfd = -1
        self._pidfd_lock = threading.Lock()  # `cancel()` (another thread) vs closing the pidfd
        self._timed_out = False
        self._cancelled = False
        self._result: SandboxResult | None = None
        try:
            self._start(program, stdin, pass_fds)
        except BaseException:
            shutil.rmtree(self._root, ignore_errors=True)
            raise
        if self._scope is not None:
            self._scope.attach(self)  # cancels it right away if the scope was cancelled meanwhile

    def _start(self, program: str, stdin: str, pass_fds: tuple[int, ...]) -> None:
        limits = self.limits
        config = {"rlimits": _rlimits(limits), "args": [str(fd) for fd in pass_fds]}
        exe, _ = interpreter()
        inner = [exe, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(config)]
        self._out = open(self._root / "stdout", "wb")  # noqa: SIM115 (closed in wait)
        self._err = open(self._root / "stderr", "wb")  # noqa: SIM115
        self._start_time = time.monotonic()
        try:
            self._proc, self._init_pidfd = launch(
                inner,
                seccomp=seccomp_filter(limits.max_processes > 0),
                tmpfs_bytes=limits.tmpfs_bytes,
                shm_bytes=limits.shm_bytes,
                stdout=self._out,
                stderr=self._err,
                pass_fds=pass_fds,
                deadline=self._start_time + limits.wall_seconds,
            )
        except BaseException:
            self._out.close()
            self._err.close()
            raise
        payload = json.dumps({"program": program, "stdin": stdin}).encode()
        assert self._proc.stdin is not None
        try:  # the bootstrap reads all of it first thing
            self._proc.stdin.write(payload)
            self._proc.stdin.close()
        except OSError:  # it died before reading its program
            pass

    def wait(self) -> SandboxResult:
        """Wait up to the wall-clock limit (from start), kill the namespace, return the result."""
        if self._result is not None:
            return self._result
        left = self._start_time + self.limits.wall_seconds - time.monotonic()
        try:
            self._proc.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            self._timed_out = True
        self.kill()
        if self._scope is not None:
            self._scope.detach(self)
        duration = time.monotonic() - self._start_time
        self._out.close()
        self._err.close()
        cap = self.limits.max_output_bytes
        stdout = _read_capped(self._root / "stdout", cap)
        stderr = _read_capped(self._root / "stderr", cap)
        shutil.rmtree(self._root, ignore_errors=True)
        code = self._proc.returncode
        status, reason = classify(code, self._timed_out, stderr, self.limits)
        if self._cancelled and not self._timed_out:
            assert self._scope is not None
            status, reason = "killed", f"cancelled: {self._scope.reason}"
        self._result = SandboxResult(
            status=status,
            returncode=None if self._timed_out else code,
            stdout=stdout,
            stderr=stderr,
            duration_s=duration,
            reason=reason,
        )
        return self._result

    def kill(self) -> None:
        """SIGKILL the namespace's init (the kernel then kills the rest) and reap bubblewrap."""
        if self._init_pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        if self._init_pidfd >= 0:
            # readable once the init has exited, which is after every process in it has died
            select.select([self._init_pidfd], [], [], 2)
            with self._pidfd_lock:
                os.close(self._init_pidfd)
                self._init_pidfd = -1

    def cancel(self) -> None:
        """SIGKILL the namespace from any thread; the thread in `wait()` then returns at once
        with status "killed" and reaps everything as usual."""
        with self._pidfd_lock:
            self._cancelled = True
            if self._init_pidfd >= 0:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
                return
        with contextlib.suppress(OSError):  # no init known: bubblewrap itself (--die-with-parent)
            self._proc.send_signal(signal.SIGKILL)


def run_python(
    program: str, *, limits: SandboxLimits | None = None, stdin: str = ""
) -> SandboxResult:
    """Run `program` as `__main__` in a fresh sandbox; never raises for the program's failures.

    Raises `SandboxUnavailable` when the OS sandbox cannot run on this machine.
    """
    return Sandbox(program, limits=limits, stdin=stdin).wait()


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    """(name, soft, hard); the CPU hard limit is one second later so SIGXCPU comes first."""
    cpu = max(1, int(limits.cpu_seconds))
    fixed = [
        ("RLIMIT_AS", int(limits.memory_bytes)),
        ("RLIMIT_FSIZE", int(limits.max_file_bytes)),
        ("RLIMIT_NOFILE", int(limits.max_open_files)),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_NPROC", int(limits.max_threads) + int(limits.max_processes)),
    ]
    return [("RLIMIT_CPU", cpu, cpu + 1), *((name, v, v) for name, v in fixed)]


def _read_capped(path: Path, cap: int) -> str:
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    text = data[:cap].decode("utf-8", errors="replace")
    return text + "\n[output truncated]" if len(data) > cap else text


_SIGNAL_STATUS: dict[int, tuple[Status, str]] = {
    signal.SIGXCPU: ("cpu_limit", "CPU time limit of {cpu} s exceeded"),
    signal.SIGXFSZ: ("file_limit", "file size limit of {fsize} bytes exceeded"),
}


def classify(
    returncode: int | None, timed_out: bool, stderr: str, limits: SandboxLimits
) -> tuple[Status, str]:
    """(status, human reason) for a finished run; pure so each outcome is testable.

    bubblewrap reports the program's death by signal N as exit status 128 + N.
    """
    if timed_out:
        return "timeout", (
            f"wall-clock limit of {limits.wall_seconds:g} s exceeded; sandbox killed"
        )
    if returncode == 0:
        return "ok", "exited with status 0"
    if returncode is not None and returncode > 128:
        returncode = -(returncode - 128)
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig in _SIGNAL_STATUS:
            status, template = _SIGNAL_STATUS[sig]
            return status, template.format(cpu=limits.cpu_seconds, fsize=limits.max_file_bytes)
        if sig == signal.SIGKILL:
            return "killed", f"killed by SIGKILL (CPU hard limit {limits.cpu_seconds} s or OOM)"
        with contextlib.suppress(ValueError):
            return "killed", f"killed by {signal.Signals(sig).name}"
        return "killed", f"killed by signal {sig}"
    last = _last_error_line(stderr)
    if last.startswith("MemoryError"):
        return "memory", f"MemoryError: address space limit of {limits.memory_bytes} bytes"
    if "File too large" in last:  # Python ignores SIGXFSZ, so the write fails with EFBIG
        return "file_limit", f"file size limit of {limits.max_file_bytes} bytes exceeded"
    return "error", last or f"exited with status {returncode}"


def _last_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and ln != "[output truncated]"]
    return lines[-1] if lines else ""
