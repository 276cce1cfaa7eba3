"""The README test's own machinery (harness/readme/blocks.py): how blocks are found and marked,
and how one runs. The blocks themselves run in tests/e2e/test_readme.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.readme.blocks import (
    Block,
    ClusterShell,
    ReadmeError,
    clean_copy,
    parse_blocks,
    run_block,
)

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_every_readme_shell_block_is_run_skipped_with_a_reason_or_cluster():
    blocks = parse_blocks(README)
    fences = sum(1 for line in README.splitlines() if line.strip() in ("```bash", "```sh"))
    assert len(blocks) == fences >= 5
    assert all(b.reason for b in blocks if b.kind == "skip")
    assert {b.kind for b in blocks} == {"run", "skip", "cluster"}


def test_the_quickstart_runs_locally_without_the_makefile_variable():
    quickstart = next(b for b in parse_blocks(README) if b.name == "quickstart")
    commands = [c.split("#")[0].strip() for _, c in quickstart.commands()]
    assert quickstart.kind == "run"
    assert "lorarl run examples/quickstart.yaml --local" in commands
    assert "LORARL_ENGINE_PYTHON" not in quickstart.text


def test_the_cluster_section_is_marked_cluster():
    """Its blocks run against the cluster harness, or are skipped by name (the GPU job);
    nothing outside it needs a cluster."""
    section_kinds = {b.name: b.kind for b in parse_blocks(section("Install on a cluster"))}
    cluster = {name for name, kind in section_kinds.items() if kind == "cluster"}
    kinds = {b.name: b.kind for b in parse_blocks(README)}
    assert cluster == {name for name, kind in kinds.items() if kind == "cluster"} != set()
    assert set(section_kinds.values()) <= {"cluster", "skip"}
    assert {"helm-install", "run-a-job", "status-api"} <= cluster


@pytest.mark.parametrize(
    ("markdown", "message"),
    [
        ("<!-- readme-test: skp -->\n```bash\nls\n```\n", "unknown readme-test word 'skp'"),
        ("<!-- readme-test: skip name=x -->\n```bash\nls\n```\n", "must say why"),
        ("<!-- readme-test: name=x -->\ntext\n```bash\nls\n```\n", "without a block"),
        ("<!-- readme-test: name=x -->\n", "without a block"),
        ("<!-- readme-test: name=x -->\n```yaml\na: 1\n```\n", "on a yaml block"),
        ("```bash\nls\n", "never closed"),
        ("```bash\nls \\\n```\n", "continuation runs off"),
        ("<!-- readme-test: name=a -->\n```bash\nls\n```\n" * 2, "must be unique"),
        ("<!-- readme-test: name=x expect=( -->\n```bash\nls\n```\n", "not a regex"),
    ],
)
def test_bad_markup_fails_loudly(markdown: str, message: str):
    with pytest.raises(ReadmeError, match=message):
        for block in parse_blocks(markdown):
            block.commands()


def test_tags_and_commands():
    (block,) = parse_blocks(
        '<!-- readme-test: cluster name=api exit=2 timeout=5 reason="a b" -->\n'
        "```bash\n# a comment\nkubectl get lrj \\\n  -n x   # trailing\n\necho done\n```\n"
    )
    assert (block.kind, block.name, block.exit, block.timeout_s, block.reason, block.line) == (
        "cluster", "api", 2, 5.0, "a b", 2,
    )  # fmt: skip
    assert block.commands() == [(4, "kubectl get lrj    -n x   # trailing"), (7, "echo done")]
    (tagged,) = parse_blocks("<!-- readme-test: expect='\"a\":[0-9]+' -->\n```bash\nls\n```\n")
    assert (tagged.expect, block.expect) == ('"a":[0-9]+', "")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory with a stand-in `.venv/bin/activate`, as in the clean copy."""
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("export ACTIVATED=yes\n")
    return tmp_path


def run(text: str, workdir: Path, cluster: ClusterShell | None = None):
    return run_block(Block("b", 10, text), workdir, workdir / "logs", cluster)


def test_a_failure_anywhere_in_the_block_fails_it(workdir: Path):
    ok = run("true\necho fine\n", workdir)
    assert ok.code == 0 and ok.failed_command is None and "fine" in ok.output
    left = run("false && echo never\necho after\n", workdir)
    assert left.code == 1 and left.failed_command == (11, "false && echo never")
    assert "after" not in left.output
    piped = run("sh -c 'exit 3' | cat\n", workdir)
    assert piped.code == 3


def test_blocks_get_a_fresh_environment_with_only_the_venv_activated(workdir, monkeypatch):
    monkeypatch.setenv("LORARL_ENGINE_PYTHON", "/somewhere/python")
    outcome = run('test "$ACTIVATED" = yes\ntest -z "${LORARL_ENGINE_PYTHON:-}"\n', workdir)
    assert outcome.code == 0, outcome.output
    cluster = run('test "$KUBECONFIG" = /k\n', workdir, ClusterShell({"KUBECONFIG": "/k"}))
    assert cluster.code == 0, cluster.output


def test_a_block_that_hangs_is_stopped(workdir: Path):
    outcome = run_block(Block("b", 1, "sleep 60 &\nsleep 60\n", timeout_s=1), workdir, workdir)
    assert outcome.code == -1 and "did not finish within 1 s" in outcome.output


def test_the_clean_copy_has_tracked_files_and_linked_venvs(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / ".venv").mkdir(parents=True)
    (repo / "tracked.txt").write_text("yes")
    (repo / "gone.txt").write_text("deleted later")
    (repo / "untracked.txt").write_text("no")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "tracked.txt", "gone.txt"], cwd=repo, check=True)
    (repo / "gone.txt").unlink()
    (repo / "tracked.txt").write_text("edited")  # the working tree's content is what is tested
    copy = clean_copy(repo, tmp_path / "copy")
    assert (copy / "tracked.txt").read_text() == "edited"
    assert not (copy / "untracked.txt").exists() and not (copy / "gone.txt").exists()
    assert (copy / ".venv").is_symlink() and (copy / ".venv").resolve() == (repo / ".venv")
