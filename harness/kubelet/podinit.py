"""One container's filesystem and identity, set up as root inside its fresh namespaces, then exec.

Run by the kubelet as `ip netns exec <pod netns> unshare --mount --propagation private --uts
--pid --fork --kill-child --mount-proc python -I podinit.py <spec.json>`: the network namespace is
the pod's, the mount, UTS and PID namespaces the container's own (the container's command ends up
as PID 1, and everything in it dies with it, as in a container runtime).

The root is a fresh tmpfs holding read-only recursive binds of the host's top-level directories
(so the venvs under the repository are there, read-only) and no host /tmp or /run; /dev is a small
tmpfs with the usual device nodes and a private /dev/shm (64 MiB unless the pod mounts its own, as
container runtimes do). Volume mount points missing from the host are created in the tmpfs, or in
an overlay on the host directory they sit in, so the host is never written. Then the root is made
read-only (readOnlyRootFilesystem), the volumes are bound, and `setpriv` drops to the pod's user.

Standard library only; failures are written to the spec's `status_file` as the runtime's
waiting/terminated reason, which the kubelet reports on the pod.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

SKIP_TOP = {"proc", "sys", "dev", "tmp", "run", "lost+found"}
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx"}  # fmt: skip
START_ERROR = 128


class InitError(RuntimeError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise InitError("CreateContainerError", f"mount {' '.join(args)}: {done.stderr.strip()}")


def mounts_under(root: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    return [p for p in points if p.startswith(root + "/")]


class Rootfs:
    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.root = spec["root"]
        self.scratch = spec["root"] + ".scratch"
        self.overlays: list[str] = []

    def build(self) -> None:
        for d in (self.root, self.scratch):
            os.makedirs(d, exist_ok=True)
        mount("-t", "tmpfs", "-o", "mode=755", "lorarl-root", self.root)
        mount("-t", "tmpfs", "-o", "mode=700", "lorarl-scratch", self.scratch)
        for name in sorted(os.listdir("/")):
            if name in SKIP_TOP:
                continue
            src, dst = f"/{name}", f"{self.root}/{name}"
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            elif os.path.isdir(src):
                os.mkdir(dst, os.stat(src).st_mode & 0o7777)
                mount("--rbind", src, dst)
            elif os.path.isfile(src):
                Path(dst).touch()
                mount("--bind", src, dst)
        for name in ("proc", "sys"):
            os.mkdir(f"{self.root}/{name}", 0o555)
            mount("--rbind", f"/{name}", f"{self.root}/{name}")
        for path in self.spec.get("reachable") or []:
            self._reachable(path)
        for point in mounts_under(self.root):
            if not point.startswith(f"{self.root}/proc"):
                mount("-o", "remount,bind,ro", point)
        os.mkdir(f"{self.root}/tmp", 0o1777)
        os.chmod(f"{self.root}/tmp", 0o1777)
        os.mkdir(f"{self.root}/run", 0o755)
        self._dev()

    def _reachable(self, path: str) -> None:
        """Let the container's user reach `path` (the local interpreter standing in for the
        image's, which may live under a private directory such as /root on a dev machine): a
        directory on the way that others cannot search is replaced by a tmpfs holding only the
        next step, bound from the host. An image's own interpreter is reachable, so this only
        removes an artefact of running images from local venvs."""
        parts = Path(path).parts[1:]
        current = ""
        for i, part in enumerate(parts[:-1]):
            current += f"/{part}"
            if os.stat(current).st_mode & 0o001:
                continue
            nxt = f"{current}/{parts[i + 1]}"
            target = f"{self.root}{nxt}"
            mount("-t", "tmpfs", "-o", "mode=755", "lorarl-path", f"{self.root}{current}")
            if os.path.isdir(nxt):
                os.mkdir(target)
            else:
                Path(target).touch()
            mount("--rbind", nxt, target)

    def _dev(self) -> None:
        dev = f"{self.root}/dev"
        os.mkdir(dev, 0o755)
        mount("-t", "tmpfs", "-o", "mode=755,size=1m", "lorarl-dev", dev)
        for node in DEV_NODES:
            Path(f"{dev}/{node}").touch()
            mount("--bind", f"/dev/{node}", f"{dev}/{node}")
        for name, target in DEV_LINKS.items():
            os.symlink(target, f"{dev}/{name}")
        os.mkdir(f"{dev}/pts", 0o755)
        os.mkdir(f"{dev}/shm", 0o1777)
        mount("-t", "tmpfs", "-o", f"mode=1777,size={self.spec['shm_size']}", "shm", f"{dev}/shm")

    def ensure(self, path: str, is_file: bool) -> str:
        """`path` (inside the container) exists; missing parts are made without touching the
        host: in the root tmpfs, or in an overlay on the nearest host directory."""
        path = self.inside(path)
        target = self.root + path
        if os.path.lexists(target):
            return target
        parts = Path(path).parts[1:]
        current = self.root
        for i, part in enumerate(parts):
            nxt = f"{current}/{part}"
            if not os.path.lexists(nxt):
                try:
                    self._make(nxt, is_file and i == len(parts) - 1)
                except OSError as exc:  # EROFS: a host directory, bound read-only
                    if exc.errno != errno.EROFS or current in self.overlays:
                        raise
                    self._overlay(current)
                    self._make(nxt, is_file and i == len(parts) - 1)
            current = nxt
        return target

    def inside(self, path: str) -> str:
        """`path` with each symlink on the way resolved within the root: an absolute link (the
        host's /var/run -> /run) names a path in the container, never one on the host."""
        parts, out, hops = list(Path(path).parts[1:]), "", 0
        while parts:
            part = parts.pop(0)
            if part in (".", ""):
                continue
            if part == "..":
                out = out.rsplit("/", 1)[0]
                continue
            if os.path.islink(self.root + f"{out}/{part}"):
                hops += 1
                if hops > 40:
                    raise OSError(errno.ELOOP, f"too many links resolving {path}")
                link = os.readlink(self.root + f"{out}/{part}")
                if link.startswith("/"):
                    out = ""
                parts = [*Path(link).parts[1 if link.startswith("/") else 0 :], *parts]
                continue
            out += f"/{part}"
        return out or "/"

    @staticmethod
    def _make(path: str, is_file: bool) -> None:
        if is_file:
            Path(path).touch()
        else:
            os.mkdir(path, 0o755)

    def _overlay(self, directory: str) -> None:
        key = f"{self.scratch}/{len(self.overlays)}"
        for sub in ("lower", "upper", "work"):
            os.makedirs(f"{key}/{sub}")
        mount("--bind", directory, f"{key}/lower")  # the ro bind, before it is covered
        layers = f"lowerdir={key}/lower,upperdir={key}/upper,workdir={key}/work"
        mount("-t", "overlay", "overlay", "-o", layers, directory)
        self.overlays.append(directory)

    def finish(self) -> None:
        self._accounts()
        volumes = sorted(self.spec["mounts"], key=lambda m: m["dst"].count("/"))
        targets = [self.ensure(m["dst"], os.path.isfile(m["src"])) for m in volumes]
        workdir = self.spec.get("workdir") or "/"
        self.ensure(workdir, False)
        if self.spec["read_only_root"]:
            for point in [*self.overlays, self.root]:
                mount("-o", "remount,bind,ro", point)
        for m, target in zip(volumes, targets, strict=True):
            if not os.path.lexists(target):
                # Hidden by a volume mounted over a parent (a cert dir under a /tmp emptyDir):
                # made inside that volume, as runtimes make nested mount points.
                os.makedirs(os.path.dirname(target), exist_ok=True)
                self._make(target, os.path.isfile(m["src"]))
            mount("--bind", m["src"], target)
            if m.get("ro"):
                mount("-o", "remount,bind,ro", target)
        for path in self.spec.get("host_paths") or []:
            self._host_path(path)

    def _accounts(self) -> None:
        """The image's users in /etc/passwd and /etc/group (the host's, plus those lines), bound
        over the root's copies: the image's user has a name, as it has in the image."""
        for name in ("passwd", "group"):
            lines = self.spec.get(name) or []
            if not lines:
                continue
            made = f"{self.scratch}/{name}"
            with open(f"/etc/{name}") as host, open(made, "w") as out:
                out.write(host.read().rstrip("\n") + "\n" + "\n".join(lines) + "\n")
            os.chmod(made, 0o644)
            mount("--bind", made, f"{self.root}/etc/{name}")

    def _host_path(self, path: str) -> None:
        """The checkout that holds the local venvs, where the root view leaves it out: a clone
        under /tmp would otherwise be hidden by the container's own /tmp, and with it every
        interpreter standing in for an image. Bound read-only at its own path (venvs hold
        absolute paths), after the volumes, so a /tmp emptyDir gets only its mount point."""
        if Path(path).parts[1] not in SKIP_TOP:
            return
        target = self.ensure(path, False)
        mount("--rbind", path, target)
        mount("-o", "remount,bind,ro", target)


def resolve(argv0: str, env: dict[str, str]) -> str | None:
    if "/" in argv0:
        return argv0 if os.access(argv0, os.X_OK) else None
    return shutil.which(argv0, path=env.get("PATH", ""))


def exec_container(spec: dict) -> None:
    os.chroot(spec["root"])
    workdir = spec.get("workdir") or "/"
    os.chdir(workdir)
    argv, env = spec["argv"], spec["env"]
    if not argv or resolve(argv[0], env) is None:
        raise InitError(
            "StartError",
            f'exec: "{argv[0] if argv else ""}": executable file not found in $PATH',
        )
    priv = ["setpriv"]
    if spec.get("uid") is not None:
        priv += ["--reuid", str(spec["uid"])]
    if spec.get("gid") is not None:
        priv += ["--regid", str(spec["gid"])]
    groups = spec.get("groups") or []
    priv += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    if spec.get("no_new_privs"):
        priv.append("--no-new-privs")
    if spec.get("drop_caps"):
        priv += ["--inh-caps=-all", "--bounding-set=-all"]
    os.execve("/usr/bin/setpriv", [*priv, "--", *argv], env)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    status = open(spec["status_file"], "w")  # noqa: SIM115 (outlives the chroot; cloexec)
    try:
        socket.sethostname(spec["hostname"])
        fs = Rootfs(spec)
        fs.build()
        fs.finish()
        exec_container(spec)
    except InitError as exc:
        fail(status, exc.reason, str(exc))
    except OSError as exc:
        fail(status, "CreateContainerError", f"{type(exc).__name__}: {exc}")


def fail(status, reason: str, message: str) -> None:
    status.write(json.dumps({"reason": reason, "message": message}))
    status.close()
    print(f"podinit: {reason}: {message}", file=sys.stderr, flush=True)
    sys.exit(START_ERROR)


if __name__ == "__main__":
    main()
