"""The local hub server against huggingface_hub's real client: what lorarl's hub tests rely on
(the same files, the commit sha, the client's own exception types, a cache that is not fetched
twice) holds for the protocol the client speaks."""

from __future__ import annotations

import filecmp
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from harness.services.hub_server import HubServer
from harness.workloads.tiny_models import make_tiny_model

REPO = "org/tiny"
GATED = "org/gated"
TOKEN = "hf_test_token"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("hub") / "tiny", layers=1)
    (path / "sub").mkdir()
    (path / "sub" / "notes.txt").write_text("a file in a folder\n")
    return path


@pytest.fixture
def hub(model: Path) -> Iterator[HubServer]:
    with HubServer({REPO: model, GATED: model}, tokens={GATED: TOKEN}) as server:
        yield server


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_snapshot_download_gives_the_same_files_and_the_commit(
    hub: HubServer, model: Path, tmp_path: Path
) -> None:
    path = Path(snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url))
    assert path.name == hub.sha(REPO)
    assert len(path.name) == 40 and int(path.name, 16) >= 0
    assert _files(path) == _files(model)
    _, mismatch, errors = filecmp.cmpfiles(model, path, _files(model), shallow=False)
    assert (mismatch, errors) == ([], [])
    assert (tmp_path / "models--org--tiny" / "refs" / "main").read_text() == hub.sha(REPO)


def test_a_second_download_of_the_same_commit_gets_no_file(hub: HubServer, tmp_path: Path) -> None:
    snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url)
    gets = hub.count("get")
    assert gets == len(_files(tmp_path / "models--org--tiny" / "snapshots" / hub.sha(REPO)))
    assert hub.count("get", path="config.json") == 1
    # By branch: one info call to resolve main, then everything comes from the cache.
    snapshot_download(REPO, cache_dir=tmp_path, endpoint=hub.url)
    # By sha: not even that.
    info = hub.count("info")
    snapshot_download(REPO, revision=hub.sha(REPO), cache_dir=tmp_path, endpoint=hub.url)
    assert hub.count("get") == gets
    assert hub.count("info") == info


def test_hf_hub_download_and_model_info(hub: HubServer, model: Path, tmp_path: Path) -> None:
    file = hf_hub_download(REPO, "config.json", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(file).read_bytes() == (model / "config.json").read_bytes()
    nested = hf_hub_download(REPO, "sub/notes.txt", cache_dir=tmp_path, endpoint=hub.url)
    assert Path(nested).read_text() == "a file in a folder\n"
    info = HfApi(endpoint=hub.url).model_info(REPO)
    assert info.id == REPO and info.sha == hub.sha(REPO)
    assert sorted(s.rfilename for s in info.siblings or []) == _files(model)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download(REPO, "missing.json", cache_dir=tmp_path, endpoint=hub.url)


def test_publish_moves_main_and_keeps_old_commits(
    hub: HubServer, model: Path, tmp_path: Path
) -> None:
    old = hub.sha(REPO)
    new_folder = tmp_path / "v2"
    new_folder.mkdir()
    (new_folder / "config.json").write_text('{"v": 2}')
    new = hub.publish(REPO, new_folder)
    assert new != old and len(new) == 40
    assert HfApi(endpoint=hub.url).model_info(REPO).sha == new
    assert HfApi(endpoint=hub.url).model_info(REPO, revision=old).sha == old
    path = Path(snapshot_download(REPO, revision=old, cache_dir=tmp_path / "c", endpoint=hub.url))
    assert path.name == old and _files(path) == _files(model)


def test_a_gated_repo_needs_its_token(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(GatedRepoError):
        snapshot_download(GATED, cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(GatedRepoError):
        snapshot_download(GATED, cache_dir=tmp_path, endpoint=hub.url, token="wrong")
    path = Path(snapshot_download(GATED, cache_dir=tmp_path, endpoint=hub.url, token=TOKEN))
    assert path.name == hub.sha(GATED)


def test_unknown_repo_and_revision_raise_the_clients_errors(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(RepositoryNotFoundError) as e:
        snapshot_download("org/nope", cache_dir=tmp_path, endpoint=hub.url)
    assert not isinstance(e.value, GatedRepoError)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("nope")
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="v9", cache_dir=tmp_path, endpoint=hub.url)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="0" * 40, cache_dir=tmp_path, endpoint=hub.url)


def test_stop_cuts_the_clients_keep_alive_connections(hub: HubServer) -> None:
    api = HfApi(endpoint=hub.url)
    api.model_info(REPO)  # leaves a pooled connection open
    hub.stop()
    with pytest.raises(httpx2.TransportError):
        api.model_info(REPO)


def test_ranges_and_any_interface(model: Path) -> None:
    with HubServer({REPO: model}, host="0.0.0.0") as hub:
        url = f"{hub.url}/{REPO}/resolve/main/config.json"
        whole = (model / "config.json").read_bytes()
        part = httpx.get(url, headers={"Range": "bytes=10-"})
        assert part.status_code == 206 and part.content == whole[10:]
        assert part.headers["Content-Range"] == f"bytes 10-{len(whole) - 1}/{len(whole)}"
        head = httpx.head(url)
        assert head.headers["X-Repo-Commit"] == hub.sha(REPO)
        assert int(head.headers["Content-Length"]) == len(whole)
        assert "X-Xet-Hash" not in head.headers
