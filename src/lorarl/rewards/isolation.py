"""The OS boundary around sandboxed programs: a bubblewrap command line and a seccomp filter.

Python audit hooks are not a security boundary (docs/security.md: a program switched one off with
`gc`), so every guarantee here comes from the kernel:

- namespaces (bubblewrap `--unshare-all --unshare-user --disable-userns`): user, mount, pid, net,
  ipc, uts and cgroup. The program sees only its own processes (its `/proc` is a fresh procfs of
  its pid namespace, so the caller's `/proc/<pid>/environ` does not exist there), has no network
  interface but a down loopback, and cannot create further user namespaces;
- a fresh root: an empty tmpfs with read-only binds of /usr, the interpreter's install prefix
  and a few loader files from /etc, a minimal /dev and a private, size-capped tmpfs at /tmp as
  the only writable place. Nothing of the caller's working tree, home or secrets is mounted;
- an empty environment (`--clearenv`) plus PATH/HOME/TMPDIR/LANG;
- `--die-with-parent` and a private pid namespace: when the namespace's init dies (normal exit,
  the wall-clock kill, or the caller dying) the kernel kills every process left in it, however
  often it forked or called setsid;
- a seccomp filter (libseccomp through `pyseccomp` or Debian's `python3-seccomp`): process
  creation (fork, vfork, clone without CLONE_THREAD) unless the caller allows it, signals to the
  namespace's init (the only parent it can see), ptrace and
  cross-process memory access, pidfd signalling and fd theft, keyrings, bpf, perf, io_uring,
  userfaultfd, mounts and kernel modules fail with EPERM.

Where namespaces cannot be created (a pod with all capabilities dropped and no unprivileged user
namespaces), `check_available` raises `SandboxUnavailable` saying what to do; nothing falls back
to a weaker in-process check.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from functools import lru_cache

__all__ = ["SandboxUnavailable", "bwrap_argv", "check_available", "seccomp_filter"]

SANDBOX_UID = 65534  # "nobody" inside the user namespace
_CLONE_THREAD = 0x00010000

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


@lru_cache(maxsize=2)
def seccomp_filter(allow_fork: bool) -> bytes:
    """The compiled BPF program bubblewrap loads before it execs the interpreter."""
    sc = _seccomp_module()
    f = sc.SyscallFilter(defaction=sc.ALLOW)
    eperm = sc.ERRNO(errno.EPERM)
    denied = _DENIED if allow_fork else _DENIED + _FORK
    for name in denied:
        try:
            f.add_rule(eperm, name)
        except (ValueError, RuntimeError, OSError):  # not a syscall on this architecture
            continue
    # The pid namespace's init (pid 1, bubblewrap) is the program's only view of its parent:
    # signalling it fails loudly instead of being dropped without a word.
    for name in ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.add_rule(eperm, name, sc.Arg(0, sc.MASKED_EQ, 0xFFFFFFFF, 1))
    if not allow_fork:
        # Threads (CLONE_THREAD) stay allowed; every other clone makes a process. clone3 passes
        # its flags in memory a filter cannot read: ENOSYS makes glibc fall back to clone.
        f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, _CLONE_THREAD, 0))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
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


def bwrap_argv(*, seccomp_fd: int, info_fd: int, tmpfs_bytes: int, argv: list[str]) -> list[str]:
    """The bubblewrap command that runs `argv` (starting with the interpreter) in a fresh root."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(f"`bwrap` is not installed; {HELP}")
    _, prefix = interpreter()
    out = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
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
        out += ["--ro-bind", prefix, prefix]
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"):
        out += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    out += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(int(tmpfs_bytes)),
        "--tmpfs",
        "/tmp",
        "--chdir",
        "/tmp",
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


@lru_cache(maxsize=1)
def _probe() -> None:
    """Run `python -c pass` with the full isolation once; cached only when it works."""
    seccomp = seccomp_filter(False)
    exe, _ = interpreter()
    r, w = os.pipe()
    ir, iw = os.pipe()
    try:
        os.write(w, seccomp)
        os.close(w)
        w = -1
        argv = bwrap_argv(
            seccomp_fd=r, info_fd=iw, tmpfs_bytes=1 << 20, argv=[exe, "-I", "-S", "-c", "pass"]
        )
        done = subprocess.run(
            argv, pass_fds=(r, iw), env={}, capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"bubblewrap could not start ({exc}); {HELP}") from exc
    finally:
        for fd in (r, w, ir, iw):
            if fd >= 0:
                os.close(fd)
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip()[-300:]
        raise SandboxUnavailable(f"bubblewrap failed here: {why!r}; {HELP}")


def check_available() -> None:
    """Raise `SandboxUnavailable` unless the full isolation works on this machine."""
    _probe()
