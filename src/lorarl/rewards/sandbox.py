"""Run untrusted Python (model completions) in a child process behind layered limits.

Each layer works without privileges, because reward pods run as non-root:

- own session / process group: the wall-clock timeout SIGKILLs the whole group, so children
  spawned despite the other layers die with their parent;
- rlimits set by the child on itself before any untrusted code runs (hard = soft, so the code
  can't raise them back): CPU seconds (SIGXCPU), address space (big allocations raise
  MemoryError), processes (RLIMIT_NPROC counts *every* process of the uid, so only 0 is a
  meaningful value in a shared container; root ignores it), file size (SIGXFSZ), open files,
  no core dumps;
- a fresh temp dir as cwd and HOME, an isolated interpreter (`-I -S -B`: no PYTHON* env, no
  site-packages, no bytecode writes) and an environment with only PATH/HOME/TMPDIR/LANG;
- a `sys.addaudithook` hook installed before the untrusted code: it refuses sockets and DNS,
  process creation (fork/exec/spawn/system/subprocess/posix_spawn), signalling other processes,
  rlimit changes, ctypes and `_posixsubprocess` imports, and any write, create, delete, rename or
  chmod outside the temp dir. Every refusal is also written to stderr, so it shows up in the
  result even if the code swallows the exception;
- when `unshare -rn` works here (user namespaces allowed), the child also gets an empty network
  namespace: even code that slipped past the hook has no interface to talk to.

What these layers cannot stop: audit hooks are not a security boundary in CPython (C extensions
already imported and memory corruption bypass them), reads are allowed everywhere the uid can
read, and without a network namespace a native-code escape could reach the network. Pod-level
controls (read-only root filesystem, NetworkPolicy, seccomp, a non-root uid) are the backstop.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "Status",
    "network_namespace_available",
    "run_python",
]

Status = Literal["ok", "error", "refused", "memory", "timeout", "cpu_limit", "file_limit", "killed"]

_MIB = 1024 * 1024
_REFUSAL_PREFIX = "lorarl-sandbox: refused "


@dataclass(frozen=True)
class SandboxLimits:
    """Limits for one run; defaults suit scoring a short solution against a few tests."""

    wall_seconds: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 512 * _MIB
    max_processes: int = 0
    max_file_bytes: int = 8 * _MIB
    max_open_files: int = 64
    max_output_bytes: int = 1 * _MIB
    network_namespace: bool | None = None  # None: use `unshare -rn` when it works here
    audit_hook: bool = True  # turn off only to test the other layers on their own
    temp_root: str | None = None  # where work dirs are created (default: the system temp dir)

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "max_file_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0 (got {getattr(self, name)})")
        if self.max_open_files < 16:
            raise ValueError(
                f"SandboxLimits.max_open_files must be >= 16 (got {self.max_open_files}): "
                "the interpreter itself needs a few"
            )
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
    refused: list[str] = field(default_factory=list)  # audit events the hook refused

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# The child's first code: lower its own limits, install the audit hook, then run the program.
# Kept as source (run with `-c`) so the child needs nothing importable from lorarl.
_BOOTSTRAP = r"""
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

class SandboxViolation(PermissionError):
    pass

def _install_hook(work, prefix):
    import os as _os
    work = _os.path.realpath(work)
    write_flags = _os.O_WRONLY | _os.O_RDWR | _os.O_APPEND | _os.O_CREAT | _os.O_TRUNC
    blocked = ("socket.", "subprocess.", "ctypes.", "os.exec", "os.spawn", "os.posix_spawn",
               "os.fork", "os.forkpty", "os.system", "os.kill", "os.killpg",
               "signal.pthread_kill", "resource.setrlimit", "resource.prlimit")
    blocked_imports = {"_posixsubprocess", "_ctypes", "ctypes", "multiprocessing"}
    path_args = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                 "os.symlink": (0, 1), "os.link": (0, 1), "os.chmod": (0,), "os.chown": (0,),
                 "os.chflags": (0,), "os.truncate": (0,), "os.utime": (0,),
                 "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,),
                 "shutil.move": (0, 1), "shutil.copyfile": (1,), "shutil.copytree": (1,),
                 "os.mkfifo": (0,), "os.mknod": (0,)}
    write = _os.write

    def inside(path):
        if isinstance(path, int):
            return True  # an fd we already hold
        try:
            path = _os.fsdecode(path)
        except TypeError:
            return False
        real = _os.path.realpath(path)
        return real == work or real.startswith(work + _os.sep)

    def refuse(event, why):
        try:
            write(2, (prefix + event + ": " + why + "\n").encode())
        except OSError:
            pass
        raise SandboxViolation(event + " refused: " + why)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                refuse(event, "writes are allowed only inside the sandbox temp dir")
        elif event == "import":
            if args[0] in blocked_imports:
                refuse(event, "module " + args[0] + " is not available in the sandbox")
        elif event.startswith(blocked):
            why = "no network in the sandbox" if event.startswith("socket.") else "not allowed"
            refuse(event, why)
        elif event in path_args:
            for i in path_args[event]:
                if i < len(args) and not inside(args[i]):
                    refuse(event, "changes are allowed only inside the sandbox temp dir")

    sys.addaudithook(hook)

_program = _payload["program"]
if _cfg["hook"]:
    _install_hook(_cfg["work"], _cfg["prefix"])
del _cfg, _payload, _fd, _name, _soft, _hard, _cap, _res, _install_hook
exec(compile(_program, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether `unshare -rn` can give a child an empty network namespace on this machine."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        done = subprocess.run(
            [exe, "-rn", "true"], capture_output=True, timeout=5, check=False, env={}
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def run_python(
    program: str, *, limits: SandboxLimits | None = None, stdin: str = ""
) -> SandboxResult:
    """Run `program` as `__main__` in a fresh sandboxed interpreter; never raises for its failures.

    `stdin` is what the program reads from `sys.stdin`. stdout/stderr are captured to files
    outside the program's temp dir (bounded by the file size limit) and truncated to
    `max_output_bytes`.
    """
    limits = limits or SandboxLimits()
    root = Path(tempfile.mkdtemp(prefix="lorarl-sbx-", dir=limits.temp_root))
    try:
        return _run_in(root, program, stdin, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: Path, program: str, stdin: str, limits: SandboxLimits) -> SandboxResult:
    work = root / "work"
    work.mkdir(mode=0o700)
    config = {
        "work": str(work),
        "hook": limits.audit_hook,
        "prefix": _REFUSAL_PREFIX,
        "rlimits": _rlimits(limits),
    }
    argv = [sys.executable, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(config)]
    use_netns = (
        network_namespace_available()
        if limits.network_namespace is None
        else limits.network_namespace
    )
    if use_netns:
        argv = ["unshare", "-rn", *argv]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
    payload = json.dumps({"program": program, "stdin": stdin}).encode()
    start = time.monotonic()
    with open(root / "stdout", "wb") as out, open(root / "stderr", "wb") as err:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            cwd=work,
            env=env,
            start_new_session=True,  # own process group: one killpg stops every descendant
            close_fds=True,
        )
        timed_out = False
        try:
            proc.communicate(payload, timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
        except BrokenPipeError:  # the child died before reading its program
            pass
        _kill_group(proc.pid)  # also reaps anything the program left running
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()
    duration = time.monotonic() - start
    stdout = _read_capped(root / "stdout", limits.max_output_bytes)
    stderr = _read_capped(root / "stderr", limits.max_output_bytes)
    refused = [
        line[len(_REFUSAL_PREFIX) :]
        for line in stderr.splitlines()
        if line.startswith(_REFUSAL_PREFIX)
    ]
    status, reason = classify(proc.returncode, timed_out, stderr, limits)
    return SandboxResult(
        status=status,
        returncode=None if timed_out else proc.returncode,
        stdout=stdout,
        stderr=stderr,
        duration_s=duration,
        reason=reason,
        refused=refused,
    )


def _rlimits(limits: SandboxLimits) -> list[tuple[str, int, int]]:
    """(name, soft, hard); the CPU hard limit is one second later so SIGXCPU comes first."""
    cpu = max(1, int(limits.cpu_seconds))
    fixed = [
        ("RLIMIT_AS", int(limits.memory_bytes)),
        ("RLIMIT_NPROC", int(limits.max_processes)),
        ("RLIMIT_FSIZE", int(limits.max_file_bytes)),
        ("RLIMIT_NOFILE", int(limits.max_open_files)),
        ("RLIMIT_CORE", 0),
    ]
    return [("RLIMIT_CPU", cpu, cpu + 1), *((name, v, v) for name, v in fixed)]


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
    """(status, human reason) for a finished run; pure so each outcome is testable."""
    if timed_out:
        return "timeout", (
            f"wall-clock limit of {limits.wall_seconds:g} s exceeded; process group killed"
        )
    if returncode == 0:
        return "ok", "exited with status 0"
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig in _SIGNAL_STATUS:
            status, template = _SIGNAL_STATUS[sig]
            return status, template.format(cpu=limits.cpu_seconds, fsize=limits.max_file_bytes)
        if sig == signal.SIGKILL:
            return "killed", f"killed by SIGKILL (CPU hard limit {limits.cpu_seconds} s or OOM)"
        return "killed", f"killed by {signal.Signals(sig).name}"
    last = _last_error_line(stderr)
    if "SandboxViolation" in last:
        return "refused", last
    if last.startswith("MemoryError"):
        return "memory", f"MemoryError: address space limit of {limits.memory_bytes} bytes"
    if "File too large" in last:  # Python ignores SIGXFSZ, so the write fails with EFBIG
        return "file_limit", f"file size limit of {limits.max_file_bytes} bytes exceeded"
    return "error", last or f"exited with status {returncode}"


def _last_error_line(stderr: str) -> str:
    lines = [
        ln.strip()
        for ln in stderr.splitlines()
        if ln.strip() and not ln.startswith(_REFUSAL_PREFIX) and ln != "[output truncated]"
    ]
    return lines[-1] if lines else ""
