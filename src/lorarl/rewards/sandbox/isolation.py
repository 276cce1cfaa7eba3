"""The OS boundary around sandboxed programs: a bubblewrap command line and a seccomp filter.

Python audit hooks are not a security boundary (docs/security.md: a program switched one off with
`gc`), so every guarantee here comes from the kernel:

- an unprivileged kernel uid: the program always runs as uid 65534 with no capabilities, and that
  uid is never the caller's kernel uid 0. As root, bubblewrap's user namespace gets the mapping
  written here (`0 -> 0` for bubblewrap's own setup, `65534 -> 65534` for the program) and the
  bootstrap drops to 65534 before any untrusted code runs; as any other user, bubblewrap maps
  65534 to the caller's (non-root) uid. Either way the kernel's checks that look at the uid, not
  at capabilities (`/proc/sys`, RLIMIT_NPROC), see an ordinary user;
- namespaces (bubblewrap `--unshare-all --unshare-user`): user, mount, pid, net, ipc, uts and
  cgroup. The program sees only its own processes (its `/proc` is a fresh, read-only procfs of its
  pid namespace, so the caller's `/proc/<pid>/environ` does not exist there and `/proc/sys` cannot
  be written), has no network interface but a down loopback, and cannot create further
  namespaces (`--disable-userns` where bubblewrap allows it, and the seccomp filter always);
- a fresh root: an empty tmpfs with read-only binds of /usr, the interpreter's install prefix
  and a few loader files from /etc, a minimal read-only /dev (null, zero, full, random, urandom,
  tty) with a private, size-capped tmpfs at /dev/shm, and a private, size-capped tmpfs at /tmp:
  the only two writable places. Nothing of the caller's working tree, home or secrets is mounted;
- an empty environment (`--clearenv`) plus PATH/HOME/TMPDIR/LANG;
- `--die-with-parent` and a private pid namespace: when the namespace's init dies (normal exit,
  the wall-clock kill, or the caller dying) the kernel kills every process left in it, however
  often it forked or called setsid;
- a seccomp filter (libseccomp through `pyseccomp` or Debian's `python3-seccomp`), built only for
  the architectures it was checked on (x86_64, aarch64; anything else raises
  `SandboxUnavailable`): sockets of any family but AF_UNIX fail with EAFNOSUPPORT (no vsock, no
  netlink, no packet sockets; inet ones would only reach the down loopback anyway); process
  creation (fork, vfork, clone without CLONE_THREAD) unless the caller allows it; new namespaces
  (unshare, setns, clone with a CLONE_NEW* flag; clone3, whose flags a filter cannot read,
  fails with ENOSYS so the C library falls back to clone); signals to the namespace's init (the
  only parent it can see), ptrace and cross-process memory access, pidfd signalling and fd theft,
  keyrings, bpf, perf, io_uring, userfaultfd, mounts and kernel modules fail with EPERM.

Where namespaces cannot be created (a pod with all capabilities dropped and no unprivileged user
namespaces), `check_available` raises `SandboxUnavailable` saying what to do; nothing falls back
to a weaker in-process check.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import lru_cache
from typing import IO

__all__ = [
    "DROP_PRIVILEGES",
    "SANDBOX_UID",
    "SandboxUnavailable",
    "bwrap_argv",
    "check_available",
    "launch",
    "seccomp_filter",
]

SANDBOX_UID = 65534  # "nobody": the program's uid inside its namespace, and as root outside too
_CLONE_THREAD = 0x00010000
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_CLONE_NEW = (0x80, 0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
# Where the filter was checked: socket(2) and clone(2) are plain syscalls there, and libseccomp
# makes every other ABI of the machine (x32 and i386 on x86_64, arm32 on aarch64) kill the process.
_ARCHES = ("x86_64", "aarch64")

# Fail with EPERM: the program gets an ordinary OSError, and nothing outside is touched.
_DENIED = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_open",
    "pidfd_send_signal",
    "pidfd_getfd",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "setns",
    "unshare",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "name_to_handle_at",
    "open_by_handle_at",
)
_FORK = ("fork", "vfork")

HELP = (
    "the python_tests sandbox needs bubblewrap (Debian package `bubblewrap`) and permission to "
    "create user, mount, pid and network namespaces. In Kubernetes, run the reward service in a "
    "dedicated reward pod that allows them (a pod whose runtime permits unprivileged user "
    "namespaces, or a gVisor `runtimeClassName: gvisor`); see docs/security.md. The sandbox never "
    "falls back to an in-process check."
)


class SandboxUnavailable(RuntimeError):
    """The OS sandbox cannot run here; the message says why and what to do."""


def _seccomp_module():
    try:
        import seccomp  # Debian's python3-seccomp

        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp  # PyPI, a ctypes binding of the same libseccomp

        return pyseccomp
    except (ImportError, OSError) as exc:
        raise SandboxUnavailable(
            f"no libseccomp binding ({exc}): install lorarl[reward] (pyseccomp) or "
            f"python3-seccomp; {HELP}"
        ) from exc


def _machine() -> str:
    return os.uname().machine


@lru_cache(maxsize=2)
def seccomp_filter(allow_fork: bool) -> bytes:
    """The compiled BPF program bubblewrap loads before it execs the interpreter."""
    machine = _machine()
    if machine not in _ARCHES:
        raise SandboxUnavailable(
            f"the sandbox's seccomp filter is built and checked for {', '.join(_ARCHES)} only, not "
            f"{machine!r} (socket families, clone flags and legacy syscall ABIs differ there); "
            f"refusing to run untrusted code with an unchecked filter. {HELP}"
        )
    sc = _seccomp_module()
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    denied = _DENIED if allow_fork else _DENIED + _FORK
    for name in denied:
        try:
            f.add_rule(eperm, name)
        except (ValueError, RuntimeError, OSError):  # not a syscall on this architecture
            continue
    # Must-have rules: a failure to add one is a failure to build the filter, never a skip.
    try:
        # The pid namespace's init (pid 1, bubblewrap) is the program's only view of its parent:
        # signalling it fails loudly instead of being dropped without a word.
        for name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
            f.add_rule_exactly(eperm, name, sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, 1))
        # AF_UNIX only. The domain is compared on all 64 bits, so a value the kernel would
        # truncate to AF_UNIX is refused too (fail closed), never the other way round.
        nofamily = sc.ERRNO(errno.EAFNOSUPPORT)
        for name in ("socket", "socketpair"):
            f.add_rule_exactly(nofamily, name, sc.Arg(0, sc.NE, socket.AF_UNIX))
        # No new namespaces, even where forking is allowed.
        for flag in _CLONE_NEW:
            f.add_rule_exactly(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        if not allow_fork:
            # Threads (CLONE_THREAD) stay allowed; every other clone makes a process.
            f.add_rule_exactly(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes the C library fall
        # back to clone, where the rules above see them.
        f.add_rule_exactly(sc.ERRNO(errno.ENOSYS), "clone3")
    except (ValueError, RuntimeError, OSError) as exc:
        raise SandboxUnavailable(
            f"could not build the sandbox's seccomp filter on {machine} ({exc}); {HELP}"
        ) from exc
    r, w = os.pipe()
    try:
        with os.fdopen(w, "wb") as out:
            f.export_bpf(out)
        chunks = []
        while chunk := os.read(r, 65536):
            chunks.append(chunk)
    finally:
        os.close(r)
    return b"".join(chunks)


def interpreter() -> tuple[str, str]:
    """(the real interpreter binary, its install prefix): a venv's python is a symlink."""
    exe = os.path.realpath(sys.executable)
    return exe, os.path.realpath(sys.base_prefix)


# Run by the sandbox's interpreter before anything else (the bootstrap starts with it): become
# SANDBOX_UID with no groups and no capabilities, and refuse to go on unless the kernel uid behind
# it is not 0. As root the program starts as uid 0 of its namespace (bubblewrap's setup needs
# that); the drop is what keeps untrusted code off kernel uid 0.
DROP_PRIVILEGES = r"""
import os as _os
def _sandbox_drop(uid):
    if _os.getresuid() != (uid, uid, uid) or _os.getresgid() != (uid, uid, uid):
        _os.setgroups([])
        _os.setresgid(uid, uid, uid)
        _os.setresuid(uid, uid, uid)
    why = None
    if _os.getresuid() != (uid, uid, uid) or _os.getresgid() != (uid, uid, uid):
        why = "uid/gid not %d" % uid
    outer = None
    with open("/proc/self/uid_map") as f:
        for line in f:
            inner, out, count = map(int, line.split())
            if inner <= uid < inner + count:
                outer = out + uid - inner
    if outer in (None, 0):
        why = "uid %d maps to kernel uid %r" % (uid, outer)
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("CapPrm", "CapEff", "CapAmb") and int(value, 16):
                why = "capabilities left: %s %s" % (key, value.strip())
    if why is not None:
        _os.write(2, ("sandbox: refusing to run untrusted code: %s\n" % why).encode())
        _os._exit(125)
_sandbox_drop({uid})
del _sandbox_drop, _os
""".replace("{uid}", str(SANDBOX_UID))


def _as_root() -> bool:
    return os.geteuid() == 0


def bwrap_argv(
    *,
    seccomp_fd: int,
    info_fd: int,
    tmpfs_bytes: int,
    argv: list[str],
    shm_bytes: int = 16 << 20,
    block_fd: int = -1,
) -> list[str]:
    """The bubblewrap command that runs `argv` (starting with the interpreter) in a fresh root.

    With `block_fd` (required when the caller is root) bubblewrap waits on it until the caller
    has written the user namespace's mappings (`launch` does).
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"`bwrap` is not installed; {HELP}")
    if _as_root() and block_fd < 0:
        raise ValueError("as root the sandbox's uid mapping is written by launch(): pass block_fd")
    _, prefix = interpreter()
    out = [bwrap, "--unshare-all", "--unshare-user"]
    if block_fd >= 0:
        # bubblewrap refuses --disable-userns here; the seccomp filter refuses new namespaces.
        out += ["--userns-block-fd", str(block_fd)]
    else:
        out += ["--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    out += [
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{top}"
        if os.path.islink(path):
            out += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            out += ["--ro-bind", path, path]
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        # bubblewrap creates the missing parents (e.g. /root of a pyenv under /root) as 0700
        # directories of uid 0; the program's unprivileged uid must be able to pass them.
        parts = prefix.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            out += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        out += ["--ro-bind", prefix, prefix]
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"):
        out += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    out += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--size",
        str(int(shm_bytes)),
        "--tmpfs",
        "/dev/shm",
        "--perms",
        "1777",
        "--size",
        str(int(tmpfs_bytes)),
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/proc",
        "--remount-ro",
        "/",
        "--seccomp",
        str(seccomp_fd),
        "--info-fd",
        str(info_fd),
        "--",
        *argv,
    ]
    return out


def launch(
    argv: list[str],
    *,
    seccomp: bytes,
    tmpfs_bytes: int,
    shm_bytes: int,
    stdout: IO[bytes] | int,
    stderr: IO[bytes] | int,
    pass_fds: Sequence[int] = (),
    deadline: float,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `argv` under bubblewrap; (the bubblewrap process, a pidfd of the namespace's init).

    The pidfd is -1 when bubblewrap died before saying who its init is (its exit status says
    why). As root, the user namespace's mappings are written here, between bubblewrap creating
    the namespace and setting it up: kernel uid 0 for bubblewrap's own setup (it must create
    its new root and read the interpreter wherever it lives) and 65534 for the program, which
    the bootstrap (`DROP_PRIVILEGES`) switches to before it runs anything untrusted.
    """
    seccomp_r, seccomp_w = os.pipe()
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe() if _as_root() else (-1, -1)
    mine = [seccomp_r, seccomp_w, info_r, info_w, block_r, block_w]

    def close(fd: int) -> None:
        if fd >= 0 and fd in mine:
            os.close(fd)
            mine.remove(fd)

    proc = None
    try:
        os.write(seccomp_w, seccomp)
        close(seccomp_w)
        full = bwrap_argv(
            seccomp_fd=seccomp_r,
            info_fd=info_w,
            tmpfs_bytes=tmpfs_bytes,
            shm_bytes=shm_bytes,
            block_fd=block_r,
            argv=argv,
        )
        proc = subprocess.Popen(
            full,
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stderr,
            env={},
            pass_fds=tuple(fd for fd in (seccomp_r, info_w, block_r, *pass_fds) if fd >= 0),
            start_new_session=True,
        )
        close(seccomp_r)
        close(info_w)
        close(block_r)
        pid = _child_pid(info_r, deadline)
        close(info_r)
        pidfd = -1
        if pid is not None:
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(pid)
        if block_w >= 0:
            if pid is None or pidfd < 0:
                _kill(proc)  # it must not go on unmapped; its status says why it stopped
            else:
                try:
                    _write_mappings(pid)
                    os.write(block_w, b"1")
                except OSError as exc:
                    _kill(proc)
                    os.close(pidfd)
                    raise SandboxUnavailable(
                        f"could not map the sandbox's user namespace ({exc}); {HELP}"
                    ) from exc
        return proc, pidfd
    except BaseException:
        if proc is not None and proc.poll() is None:
            _kill(proc)
        raise
    finally:
        for fd in list(mine):
            close(fd)


def _write_mappings(pid: int) -> None:
    mapping = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(mapping)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _child_pid(info_r: int, deadline: float) -> int | None:
    """The pid of the sandbox's pid-namespace init, from bubblewrap's `--info-fd` JSON."""
    data = b""
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([info_r], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                break
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk
            with contextlib.suppress(ValueError):
                return int(json.loads(data)["child-pid"])
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def _probe() -> None:
    """Run `python -c pass` with the full isolation once; cached only when it works."""
    seccomp = seccomp_filter(False)
    exe, _ = interpreter()
    argv = [exe, "-I", "-S", "-c", DROP_PRIVILEGES + "pass"]
    try:
        proc, pidfd = launch(
            argv,
            seccomp=seccomp,
            tmpfs_bytes=1 << 20,
            shm_bytes=1 << 20,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            deadline=time.monotonic() + 30,
        )
        if pidfd >= 0:
            os.close(pidfd)
        _, err = proc.communicate(timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"bubblewrap could not start ({exc}); {HELP}") from exc
    if proc.returncode != 0:
        why = err.decode(errors="replace").strip()[-300:]
        raise SandboxUnavailable(f"bubblewrap failed here: {why!r}; {HELP}")


def check_available() -> None:
    """Raise `SandboxUnavailable` unless the full isolation works on this machine."""
    _probe()
