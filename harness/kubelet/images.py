"""Images -> local interpreters, as honestly as a machine without a container runtime allows.

An image "exists" only if the repository builds it: `make images` lists each one as
`-f <dir>/Dockerfile -t $(IMAGE_REGISTRY)/<name>:$(IMAGE_TAG)`. Anything else would fail to pull
in a cluster, so a pod naming it waits with `ErrImagePull`. A buildable image runs under the local
interpreter that holds what its Dockerfile installs: an image with vLLM -> `.venv-engine`, with
SGLang -> `.venv-sglang`, otherwise (lorarl and its extras) -> `.venv`. The image's final-stage
ENV, USER and WORKDIR apply, with the image's venv paths mapped onto the local one.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.kubelet.dockerfile import stages

ROOT = Path(__file__).resolve().parents[2]
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_VENV = "/opt/venv"
PYTHONS = (
    "python",
    "python3",
    "/usr/bin/python3",
    "/usr/local/bin/python",
    "/usr/local/bin/python3",
)
_BUILD = re.compile(r"-f\s+(\S+)\s+-t\s+(\S+)")


class ImagePullError(LookupError):
    """The image is not one the repository builds: a cluster could not pull it either."""


@dataclass(frozen=True)
class Image:
    ref: str
    dockerfile: Path
    engine: str | None  # "vllm" | "sglang" | None
    python: Path  # the local interpreter standing in for the image's
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None  # "uid[:gid]" from USER
    workdir: str = "/"
    passwd: tuple[str, ...] = ()  # /etc/passwd lines the image's `useradd` adds
    group: tuple[str, ...] = ()  # /etc/group lines (`--user-group`)

    def program(self, argv0: str) -> str:
        """The image's `python` and its venv's console scripts -> the local interpreter's."""
        bindir = self.python.parent
        if argv0 in PYTHONS or argv0.startswith(f"{IMAGE_VENV}/bin/python"):
            return str(self.python)
        if argv0.startswith(f"{IMAGE_VENV}/bin/"):
            return str(bindir / argv0.rsplit("/", 1)[1])
        if "/" not in argv0 and (bindir / argv0).exists():
            return str(bindir / argv0)
        return argv0


def _makefile_vars(text: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-Z_]+)\s*\?=\s*(\S+)\s*$", text, re.M))


def buildable(root: Path = ROOT) -> dict[str, Path]:
    """{image reference: Dockerfile} for every image `make images` builds."""
    text = (root / "Makefile").read_text()
    values = _makefile_vars(text)
    body = re.search(r"^images:.*?\n((?:\t.*\n?)+)", text, re.M)
    out: dict[str, Path] = {}
    for dockerfile, tag in _BUILD.findall(body.group(1) if body else ""):
        ref = re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), tag)
        out[ref] = root / dockerfile
    return out


def accounts(final_instructions: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """The users an image's `useradd` created: (passwd lines, group lines). A process of that
    uid finds its name (getpass, kopf's peering id) as it would in the image."""
    passwd, group = [], []
    for keyword, args in final_instructions:
        if keyword != "RUN":
            continue
        for command in re.findall(r"useradd\s+((?:[^&;|\n]|\\\n)+)", args):
            words = [w for w in shlex.split(command.replace("\\\n", " ")) if w != "\\"]
            opts: dict[str, str] = {}
            flags, name, i = set(), "", 0
            while i < len(words):
                word = words[i]
                if word in ("--uid", "-u", "--gid", "-g", "--home-dir", "-d", "--shell", "-s"):
                    opts[word.lstrip("-")[0]] = words[i + 1]
                    i += 2
                    continue
                if word.startswith("-"):
                    flags.add(word)
                else:
                    name = word
                i += 1
            if not name or "u" not in opts:
                continue
            gid = opts.get("g", opts["u"])
            home, shell = opts.get("h", f"/home/{name}"), opts.get("s", "/bin/sh")
            passwd.append(f"{name}:x:{opts['u']}:{gid}::{home}:{shell}")
            if {"--user-group", "-U"} & flags:
                group.append(f"{name}:x:{gid}:")
    return passwd, group


def _engine(text: str) -> str | None:
    final = stages(text)[-1]
    body = final.base + "\n" + "\n".join(a for k, a in final.instructions if k in ("RUN", "FROM"))
    if re.search(r"\bsglang\b", body):
        return "sglang"
    if re.search(r"\bvllm", body):
        return "vllm"
    return None


def interpreter(engine: str | None, root: Path = ROOT) -> Path:
    """The local venv standing in for an image with `engine` (absolute, never resolved: a venv's
    python only finds its packages through the path inside the venv)."""
    if engine == "vllm":
        named = os.environ.get("LORARL_ENGINE_PYTHON")
        return Path(named) if named else root / ".venv-engine" / "bin" / "python"
    if engine == "sglang":
        named = os.environ.get("LORARL_SGLANG_PYTHON")
        return Path(named) if named else root / ".venv-sglang" / "bin" / "python"
    local = root / ".venv" / "bin" / "python"
    return local if local.exists() else Path(sys.executable)


def _image_env(
    final_instructions: list[tuple[str, str]], python: Path, root: Path
) -> dict[str, str]:
    # The image holds this checkout's code (it is built from it), whichever checkout the venv's
    # editable install points at.
    env = {"PATH": BASE_PATH, "PYTHONPATH": str(root / "src")}
    for keyword, args in final_instructions:
        if keyword != "ENV":
            continue
        for item in shlex.split(args):
            name, _, value = item.partition("=")
            env[name] = re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)
    bindir = str(python.parent)
    env["PATH"] = env["PATH"].replace(f"{IMAGE_VENV}/bin", bindir)
    if bindir not in env["PATH"].split(":"):
        env["PATH"] = f"{bindir}:{env['PATH']}"  # the image's python is on its PATH
    return env


def load(ref: str, root: Path = ROOT) -> Image:
    """The image `ref`, or ImagePullError if the repository does not build it."""
    images = buildable(root)
    if ref not in images:
        raise ImagePullError(
            f'failed to pull image "{ref}": not built by this repository (`make images` builds '
            f"{', '.join(sorted(images))})"
        )
    dockerfile = images[ref]
    if not dockerfile.is_file():
        raise ImagePullError(f'failed to pull image "{ref}": {dockerfile} does not exist')
    text = dockerfile.read_text()
    engine = _engine(text)
    python = interpreter(engine, root)
    final = stages(text)[-1].instructions
    users = [a for k, a in final if k == "USER"]
    workdirs = [a for k, a in final if k == "WORKDIR"]
    passwd, group = accounts(final)
    return Image(
        ref=ref,
        dockerfile=dockerfile,
        engine=engine,
        python=python,
        env=_image_env(final, python, root),
        user=users[-1] if users else None,
        workdir=workdirs[-1] if workdirs else "/",
        passwd=tuple(passwd),
        group=tuple(group),
    )
