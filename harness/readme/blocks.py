"""Run the README's shell blocks as a newcomer types them (tests/e2e/test_readme.py).

Every ```bash block of README.md is a test case. An HTML comment on the line(s) right before a
block, invisible on GitHub, says how the test treats it:

    <!-- readme-test: name=quickstart -->                      run here (the default)
    <!-- readme-test: name=validate-bad exit=1 -->             run here; exit 1 is the success
    <!-- readme-test: skip name=demo reason="..." -->          never run; reported as a skip
    <!-- readme-test: cluster name=helm-install -->            run against a cluster harness

A block without a comment runs here under the name `line-<N>`. Keys: `name` (unique, the pytest
id), `reason` (required by `skip`), `exit` (expected status, default 0), `timeout` (seconds;
default 900, or the cluster harness's for cluster blocks), `expect` (a regular expression the
block's output must match: for what a zero exit cannot show, e.g. that a reply holds a reward).
Unknown words fail the parse, so a typo never turns into a silent skip.

A block runs in a fresh `bash --noprofile --norc` inside a clean copy of the repository (the
tracked files only, the venvs symlinked in), with a minimal environment (PATH, HOME, LANG: no
LORARL_* variable from the Makefile) and `.venv` activated. Each logical command (a line, with
`\\` continuations joined) is checked on its own: the first non-zero status ends the block, so a
failure on the left of `&&` or mid-block is never masked by a later success.

Cluster blocks (the "Install on a cluster" section) run through a `ClusterShell`: whatever a
cluster harness adds to the block's environment (PATH with `kubectl` and a `helm` shim first,
KUBECONFIG, ...). See `ClusterShell` for how to wire one.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("run", "skip", "cluster")
KEYS = ("name", "reason", "exit", "timeout", "expect")
TAG = re.compile(r"^<!--\s*readme-test:(?P<body>.*?)-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
SHELLS = ("bash", "sh", "shell", "console")
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VENVS = (".venv", ".venv-engine", ".venv-sglang")  # built by make, never copied: linked
DEFAULT_TIMEOUT_S = 900.0


class ReadmeError(ValueError):
    """The README's markup is wrong (an unknown word, a skip without a reason, a dangling tag)."""


@dataclass(frozen=True)
class Block:
    name: str
    line: int  # 1-based line of the opening fence
    text: str
    kind: str = "run"
    reason: str = ""
    exit: int = 0
    timeout_s: float | None = None  # None: the cluster's, else DEFAULT_TIMEOUT_S
    expect: str = ""  # a regex the output must match (searched, DOTALL)

    def commands(self) -> list[tuple[int, str]]:
        """(line, command) per logical command: `\\`-continued lines joined, comments dropped."""
        out: list[tuple[int, str]] = []
        pending: list[str] = []
        start = 0
        for i, raw in enumerate(self.text.splitlines(), start=self.line + 1):
            if not pending:
                if not raw.strip() or raw.lstrip().startswith("#"):
                    continue
                start = i
            if raw.rstrip().endswith("\\"):
                pending.append(raw.rstrip()[:-1])
                continue
            out.append((start, " ".join([*pending, raw]).strip()))
            pending = []
        if pending:
            raise ReadmeError(f"line {start}: a `\\` continuation runs off the end of the block")
        return out


@dataclass(frozen=True)
class ClusterShell:
    """How cluster blocks reach a cluster; the one thing a cluster harness must provide.

    `env` is added to (and overrides) the block's environment after `.venv` is activated: put the
    directory holding `kubectl` and a `helm` shim (e.g. one that installs the chart through
    `helm_python`) first on PATH, and set KUBECONFIG to the harness's kubeconfig. The harness
    owns the cluster's lifetime (a module-scoped fixture); blocks run in README order against
    it. Commands that never end on their own (`kubectl get -w`, `port-forward ... &`) need the
    shim to bound them, or `timeout_s`.
    """

    env: Mapping[str, str]
    timeout_s: float = 300.0


@dataclass
class Outcome:
    code: int
    failed_command: tuple[int, str] | None
    output: str
    seconds: float = 0.0
    log: Path | None = field(default=None, repr=False)


def parse_tag(body: str, line: int) -> dict[str, str]:
    words = shlex.split(body)
    tag: dict[str, str] = {"kind": "run"}
    for word in words:
        if word in KINDS:
            tag["kind"] = word
            continue
        key, sep, value = word.partition("=")
        if not sep or key not in KEYS:
            raise ReadmeError(f"README line {line}: unknown readme-test word {word!r}")
        tag[key] = value
    if tag["kind"] == "skip" and not tag.get("reason"):
        raise ReadmeError(f"README line {line}: a skipped block must say why (reason=...)")
    return tag


def parse_blocks(markdown: str) -> list[Block]:
    """Every shell block of `markdown`, with what its readme-test comment says."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    tag: dict[str, str] | None = None
    tag_line = 0
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        if m := TAG.match(text):
            if tag is not None:
                raise ReadmeError(f"README line {tag_line}: readme-test comment without a block")
            tag, tag_line = parse_tag(m["body"], i + 1), i + 1
        elif m := FENCE.match(text):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                raise ReadmeError(f"README line {i + 1}: code block never closed")
            if m["lang"] in SHELLS:
                blocks.append(_block(tag or {"kind": "run"}, i + 1, lines[i + 1 : end]))
            elif tag is not None:
                raise ReadmeError(
                    f"README line {tag_line}: readme-test comment on a {m['lang'] or 'plain'} block"
                )
            tag = None
            i = end
        elif text and tag is not None:
            raise ReadmeError(f"README line {tag_line}: readme-test comment without a block")
        i += 1
    if tag is not None:
        raise ReadmeError(f"README line {tag_line}: readme-test comment without a block")
    names = [b.name for b in blocks]
    if dupes := sorted({n for n in names if names.count(n) > 1}):
        raise ReadmeError(f"README block names must be unique: {dupes}")
    return blocks


def _block(tag: dict[str, str], line: int, body: list[str]) -> Block:
    try:
        re.compile(tag.get("expect", ""))
        return Block(
            name=tag.get("name") or f"line-{line}",
            line=line,
            text="\n".join(body) + "\n",
            kind=tag["kind"],
            reason=tag.get("reason", ""),
            exit=int(tag.get("exit", 0)),
            timeout_s=float(tag["timeout"]) if "timeout" in tag else None,
            expect=tag.get("expect", ""),
        )
    except ValueError as exc:
        raise ReadmeError(f"README line {line}: {exc}") from exc
    except re.error as exc:
        raise ReadmeError(f"README line {line}: expect= is not a regex: {exc}") from exc


# ------------------------------------------------------------------------- the clean checkout


def clean_copy(repo: Path, dest: Path) -> Path:
    """The repository's tracked files (their working-tree content: a fresh clone of what is being
    tested) copied into `dest`, plus the built venvs symlinked in, never rebuilt."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=repo, check=True, capture_output=True)
    dest.mkdir(parents=True, exist_ok=True)
    for rel in filter(None, listed.stdout.decode().split("\0")):
        src = repo / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree, not yet committed
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    for venv in VENVS:
        if (repo / venv).is_dir():
            (dest / venv).symlink_to((repo / venv).absolute(), target_is_directory=True)
    return dest


def fresh_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a new login shell has, no more: nothing the Makefile or the test run exported."""
    env = {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "TERM": "dumb"}
    for name in ("HOME", "USER", "LOGNAME"):
        if name in os.environ:
            env[name] = os.environ[name]
    return {**env, **(extra or {})}


def script(block: Block, extra_env: Mapping[str, str] | None = None) -> str:
    """The block as bash: the venv activated, then each command followed by a status check."""
    lines = ["set -o pipefail", "source .venv/bin/activate || exit 97"]
    for name, value in (extra_env or {}).items():
        lines.append(f"export {name}={shlex.quote(value)}")
    for number, command in block.commands():
        lines += [
            command,
            "__rc=$?; if [ $__rc -ne 0 ]; then "
            f"echo {shlex.quote(f'readme-test: line {number} exited')} $__rc >&2; exit $__rc; fi",
        ]
    return "\n".join(lines) + "\n"


def run_block(
    block: Block, workdir: Path, logs: Path, cluster: ClusterShell | None = None
) -> Outcome:
    """Run `block` in `workdir` in a fresh bash; its whole output goes to a log under `logs`."""
    extra = dict(cluster.env) if cluster else {}
    path = logs / f"{block.name}.sh"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script(block, extra))
    log = logs / f"{block.name}.log"
    timeout = block.timeout_s or (cluster.timeout_s if cluster else DEFAULT_TIMEOUT_S)
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", str(path)], cwd=workdir, env=fresh_env(),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: a timeout stops everything it started
        )  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            code = -1
            out.write(f"\nreadme-test: block did not finish within {timeout:.0f} s\n")
    output = log.read_text(errors="replace")
    failed = None
    if m := re.search(r"readme-test: line (\d+) exited", output):
        number = int(m[1])
        failed = next(((n, c) for n, c in block.commands() if n == number), (number, "?"))
    return Outcome(code, failed, output, time.monotonic() - start, log)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the block's process group (`lorarl run` stops its children on it), then KILL."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
