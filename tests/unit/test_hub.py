"""lorarl.hub against a local server speaking the hub's protocol, driven by huggingface_hub's own
client: what comes down, the cache used offline, one-line errors, pins shared by a job's pods,
and the init container's command."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.services.hub_server import HubServer
from lorarl.hub import HUB_ID_PATTERN, HubError, fetch, fetch_pinned, is_hub_id, main

REPO = "org/tiny"
GATED = "org/gated"
TOKEN = "hf_unit_token"
WANTED = [
    "chat_template.jinja",
    "config.json",
    "model.safetensors",
    "modeling_tiny.py",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.txt",
]
UNWANTED = ["pytorch_model.bin", "original/params.json", "original/consolidated.00.pth", "x.onnx"]


def _repo_folder(root: Path, version: str = "1") -> Path:
    root.mkdir(parents=True)
    for name in WANTED + UNWANTED:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"{name} v{version}\n")
    return root


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_TOKEN", "HF_ENDPOINT", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "user-cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    folder = _repo_folder(tmp_path / "repo")
    with HubServer({REPO: folder, GATED: folder}, tokens={GATED: TOKEN}) as server:
        yield server


def _one_line(e: pytest.ExceptionInfo[HubError]) -> str:
    message = str(e.value)
    assert "\n" not in message and message.startswith("spec.model.path: ")
    return message


def test_fetch_downloads_only_what_the_platform_reads(hub: HubServer, tmp_path: Path) -> None:
    snap = fetch(REPO, cache_dir=tmp_path / "cache", endpoint=hub.url)
    assert snap.repo == REPO and snap.revision == hub.sha(REPO)
    assert snap.path == tmp_path / "cache" / "models--org--tiny" / "snapshots" / snap.revision
    assert _files(snap.path) == WANTED
    assert (snap.path / "config.json").read_text() == "config.json v1\n"
    assert hub.count("get", path="pytorch_model.bin") == 0


def test_fetch_defaults_to_the_users_cache_and_hf_endpoint(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    snap = fetch(REPO)
    assert snap.path.is_relative_to(tmp_path / "user-cache")


def test_a_cached_commit_is_not_fetched_again(hub: HubServer, tmp_path: Path) -> None:
    snap = fetch(REPO, cache_dir=tmp_path / "cache", endpoint=hub.url)
    before = len(hub.requests)
    again = fetch(REPO, revision=snap.revision, cache_dir=tmp_path / "cache", endpoint=hub.url)
    assert again == snap
    assert len(hub.requests) == before


def test_offline_after_a_first_fetch(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    snap = fetch(REPO, cache_dir=cache, endpoint=hub.url)
    url = hub.url
    hub.stop()
    assert fetch(REPO, cache_dir=cache, endpoint=url) == snap  # by branch, hub unreachable
    assert fetch(REPO, revision=snap.revision, cache_dir=cache, endpoint=url) == snap
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch(REPO, cache_dir=cache, endpoint=url) == snap


def test_not_cached_and_unreachable_is_one_line(hub: HubServer, tmp_path: Path) -> None:
    url = hub.url
    hub.stop()
    with pytest.raises(HubError) as e:
        fetch(REPO, cache_dir=tmp_path / "cache", endpoint=url)
    message = _one_line(e)
    assert f"{REPO}@main" in message and url in message
    assert "HF_ENDPOINT" in message and "cache" in message


def test_offline_mode_not_cached_is_one_line(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError) as e:
        fetch(REPO, cache_dir=tmp_path / "cache", endpoint=hub.url)
    assert "HF_HUB_OFFLINE" in _one_line(e)
    assert hub.requests == []


def test_gated_needs_a_token(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubError) as e:
        fetch(GATED, cache_dir=tmp_path / "cache", endpoint=hub.url)
    message = _one_line(e)
    assert GATED in message and "spec.model.hub.tokenSecret " in message
    assert "HF_TOKEN" in message
    with pytest.raises(HubError) as e:
        fetch(GATED, cache_dir=tmp_path / "cache", endpoint=hub.url, token="wrong")
    assert "no access" in _one_line(e)
    snap = fetch(GATED, cache_dir=tmp_path / "cache", endpoint=hub.url, token=TOKEN)
    assert snap.revision == hub.sha(GATED)


def test_unknown_repo_and_revision(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(HubError) as e:
        fetch("org/nope", cache_dir=tmp_path / "cache", endpoint=hub.url)
    assert "no model org/nope" in _one_line(e)
    with pytest.raises(HubError) as e:
        fetch(REPO, revision="v9", cache_dir=tmp_path / "cache", endpoint=hub.url)
    assert "no revision 'v9'" in _one_line(e)


def test_fetch_pinned_keeps_the_jobs_commit_when_the_hub_moves(
    hub: HubServer, tmp_path: Path
) -> None:
    cache = tmp_path / "volume"
    first = fetch_pinned(REPO, cache_dir=cache, pin="job-a", endpoint=hub.url)
    assert (cache / "lorarl" / "job-a.revision").read_text().split() == [first.revision, REPO]
    new = hub.publish(REPO, _repo_folder(tmp_path / "repo-v2", version="2"))
    assert new != first.revision
    again = fetch_pinned(REPO, cache_dir=cache, pin="job-a", endpoint=hub.url)
    assert again == first
    link = cache / "lorarl" / "job-a"
    assert not os.path.isabs(os.readlink(link))
    assert link.resolve() == first.path.resolve()
    assert (link / "config.json").read_text() == "config.json v1\n"
    # Another job pins what the hub says now.
    other = fetch_pinned(REPO, cache_dir=cache, pin="job-b", endpoint=hub.url)
    assert other.revision == new
    assert (cache / "lorarl" / "job-b" / "config.json").read_text() == "config.json v2\n"


def test_a_repo_without_safetensors_weights_is_one_line_and_pins_nothing(
    hub: HubServer, tmp_path: Path
) -> None:
    """Only `*.safetensors` come down (ALLOW_PATTERNS): a `.bin`-only repo used to "download"
    without weights and fail later, in every pod, when the model loaded."""
    folder = tmp_path / "bin-only"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "pytorch_model.bin"):
        (folder / name).write_text(f"{name}\n")
    hub.publish("org/bin-only", folder)
    cache = tmp_path / "volume"
    with pytest.raises(HubError) as e:
        fetch_pinned("org/bin-only", cache_dir=cache, pin="job", endpoint=hub.url)
    assert "org/bin-only@main" in _one_line(e) and "has no *.safetensors weights" in str(e.value)
    assert not (cache / "lorarl" / "job.revision").exists()


def test_fetch_pinned_refuses_another_repo_under_the_jobs_pin(
    hub: HubServer, tmp_path: Path
) -> None:
    """A job's model changed after its pods pinned one (the webhook refuses that edit; this is
    the fetcher's own guard): one line naming both, not a "no revision" from the other repo."""
    cache = tmp_path / "volume"
    first = fetch_pinned(REPO, cache_dir=cache, pin="job-a", endpoint=hub.url)
    with pytest.raises(HubError) as e:
        fetch_pinned(GATED, cache_dir=cache, pin="job-a", endpoint=hub.url, token=TOKEN)
    message = _one_line(e)
    assert f"pinned {REPO} at commit {first.revision[:12]} and now ask for {GATED}" in message
    # A pin written before the repo was recorded (a commit alone) is still read.
    (cache / "lorarl" / "job-a.revision").write_text(first.revision + "\n")
    assert fetch_pinned(REPO, cache_dir=cache, pin="job-a", endpoint=hub.url) == first


def test_main_writes_the_sha_to_the_termination_log(
    hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    argv = ["--repo", REPO, "--cache", str(tmp_path / "volume"), "--pin", "job"]
    code = main([*argv, "--endpoint", hub.url, "--termination-log", str(log)])
    assert code == 0
    assert log.read_text() == hub.sha(REPO)
    assert len(capsys.readouterr().out.strip().splitlines()) == 1


def test_main_fails_with_one_line(
    hub: HubServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "termination-log"
    argv = ["--repo", GATED, "--cache", str(tmp_path / "volume"), "--pin", "job"]
    code = main([*argv, "--endpoint", hub.url, "--termination-log", str(log)])
    assert code == 1
    line = log.read_text()
    assert "\n" not in line and "spec.model.hub.tokenSecret " in line
    assert line in capsys.readouterr().err.splitlines()
    # Outside a pod the log's folder is missing: nothing is written, no error.
    assert main([*argv, "--endpoint", hub.url, "--termination-log", "/nonexistent/x"]) == 1


@pytest.mark.parametrize(
    ("path", "hub_id"),
    [
        ("Qwen/Qwen2.5-3B-Instruct", True),
        ("gpt2", True),
        ("org/name", True),
        ("./models/qwen", False),
        ("../qwen", False),
        ("/models/qwen", False),
        ("~/models/qwen", False),
        ("models/qwen/v1", False),
        (".hidden", False),
    ],
)
def test_is_hub_id(path: str, hub_id: bool) -> None:
    assert is_hub_id(path) is hub_id
    assert HUB_ID_PATTERN.startswith("^") and HUB_ID_PATTERN.endswith("$")


def test_a_hub_that_never_answers_fails_within_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A network that swallows traffic must not hold a pod in Init forever: huggingface_hub's
    own client waits without limit for repo info."""
    import socket
    import time

    import lorarl.hub

    monkeypatch.setattr(lorarl.hub, "READ_TIMEOUT_S", 1.0)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts (the kernel does), never answers
    endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
    argv = ["--repo", REPO, "--cache", str(tmp_path / "volume"), "--pin", "job"]
    started = time.monotonic()
    try:
        code = main([*argv, "--endpoint", endpoint, "--termination-log", str(tmp_path / "log")])
    finally:
        silent.close()
    assert code == 1 and time.monotonic() - started < 30
    line = (tmp_path / "log").read_text()
    assert "\n" not in line and line.startswith("spec.model.path:") and REPO in line
