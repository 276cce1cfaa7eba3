"""Hugging Face hub model ids as `spec.model.path`: download the files the platform reads into a
hub cache, once, and say in one line what to do when that cannot be done.

Locally `fetch` fills the user's hub cache. In a cluster an init container runs
`python -m lorarl.hub` (`main`) on a cache volume every pod of the job mounts: `fetch_pinned`
records the commit it got under `<cache>/lorarl/<pin>.revision`, so every pod (and every restart)
loads that commit even after the hub's branch moves, and links `<cache>/lorarl/<pin>` to it.

Only stdlib, huggingface_hub, filelock and `lorarl.errors` are imported: the init container runs
this module alone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock
from huggingface_hub import constants, get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import get_session

from lorarl.errors import UserError

# `name` or `org/name`; not a path (no leading `.`, `/`, `~`). Kept equal to the api's rule
# (`spec/job.py`; the api may not import this module, and the init container that runs this one
# needs only huggingface_hub and lorarl.errors) by a test.
HUB_ID_PATTERN = r"^[^./~][^/]*(/[^/]*)?$"
_HUB_ID_RE = re.compile(HUB_ID_PATTERN)
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_PIN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

# What the trainer and the engines read: config, safetensors weights, tokenizer files, and the
# code `trust_remote_code` imports. Not the other weight formats a repo often carries too.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
IGNORE_PATTERNS = ["original/*", "*/original/*"]

_DEFAULT_REVISION = "main"
# Connection-level failures by class name across http clients (httpx/httpx2's TransportError
# family, requests' ConnectionError/Timeout): huggingface_hub's transport changes between versions.
_NETWORK_ERRORS = {
    "TransportError",
    "TimeoutException",
    "ConnectionError",
    "Timeout",
    "TimeoutError",
    "OfflineModeIsEnabled",
}
_TOKEN_HOW = "spec.model.hub.tokenSecret in a cluster, HF_TOKEN or `hf auth login` locally"


def is_hub_id(path: str) -> bool:
    """Whether `spec.model.path` names a hub repo (`name`, `org/name`) rather than a folder."""
    return _HUB_ID_RE.match(path) is not None


class HubError(UserError):
    """A model could not be fetched from the hub; the message is one line and says what to do."""


@dataclass(frozen=True)
class Snapshot:
    repo: str
    revision: str  # the commit sha
    path: Path  # the snapshot folder in the hub cache


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline() -> bool:
    return (
        constants.HF_HUB_OFFLINE or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")
    )


def _endpoint(endpoint: str | None) -> str:
    """The endpoint to use, read now (huggingface_hub reads HF_ENDPOINT once, at import)."""
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _cache(cache_dir: str | Path | None) -> Path:
    """The hub cache, read now as huggingface_hub resolves it (HF_HUB_CACHE, HF_HOME/hub)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser().resolve()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser().resolve()
    if os.environ.get("HF_HOME"):
        return (Path(os.environ["HF_HOME"]) / "hub").expanduser().resolve()
    return Path(constants.HF_HUB_CACHE).expanduser().resolve()


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in seen:
        seen.append(e)
        e = e.__cause__ or e.__context__
    return seen


def _network_class(error: BaseException) -> bool:
    return any(c.__name__ in _NETWORK_ERRORS for c in type(error).__mro__)


def _is_network(error: BaseException) -> bool:
    return any(_network_class(e) for e in _chain(error))


def _short(error: BaseException) -> str:
    """The root cause in a few words, on one line."""
    chain = _chain(error)
    if _offline() or any(isinstance(e, OfflineModeIsEnabled) for e in chain):
        return "offline mode: HF_HUB_OFFLINE is set"
    network = [e for e in chain if _network_class(e)]
    http = [e for e in chain if isinstance(e, HfHubHTTPError) and e.response is not None]
    if not network and http:
        return f"HTTP {http[0].response.status_code}"
    root = network[-1] if network else chain[-1]
    text = " ".join(str(root).split())
    text = f"{type(root).__name__}: {text}" if text else type(root).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _download(
    repo: str, revision: str, cache: Path, endpoint: str, token: str | None, local: bool
) -> Path:
    return Path(
        snapshot_download(
            repo,
            revision=revision,
            cache_dir=cache,
            endpoint=endpoint,
            token=token,
            local_files_only=local,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
        )
    )


def _from_cache(repo: str, revision: str, cache: Path, endpoint: str) -> Path | None:
    try:
        return _download(repo, revision, cache, endpoint, None, True)
    except LocalEntryNotFoundError:
        return None


def _cached_commit(repo: str, revision: str, cache: Path) -> bool:
    """Whether `revision` is a commit whose file listing is in the cache (so the cache can say
    whether the snapshot is complete without asking the hub)."""
    if not _COMMIT_RE.match(revision):
        return False
    try:
        get_cached_repo_tree(repo, revision=revision, cache_dir=cache)
    except CachedRepoTreeNotFoundError:
        return False
    return True


def fetch(
    repo: str,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> Snapshot:
    """Download `repo` at `revision` (default: main) into the hub cache (default: the user's),
    only the files the platform reads; the hub is not asked when the commit is cached or
    HF_HUB_OFFLINE is set, and a cached copy is used when the hub cannot be reached.

    `token` None: huggingface_hub's own (HF_TOKEN, or the one `hf auth login` stored).
    Raises HubError (one line) when the model cannot be had.
    """
    rev = revision or _DEFAULT_REVISION
    cache = _cache(cache_dir)
    url = _endpoint(endpoint)
    where = f"{repo}@{rev}"
    try:
        try:
            local = _offline() or _cached_commit(repo, rev, cache)
            try:
                path = _download(repo, rev, cache, url, token, local)
            except LocalEntryNotFoundError:
                if not local or _offline():
                    raise
                path = _download(repo, rev, cache, url, token, False)  # cached, but incomplete
        except (RepositoryNotFoundError, RevisionNotFoundError):
            raise
        except Exception as e:
            if not (_is_network(e) or isinstance(e, LocalEntryNotFoundError)):
                raise
            # The hub went away during the download: what the cache has may do.
            cached = _from_cache(repo, rev, cache, url)
            if cached is None:
                raise
            path = cached
    except GatedRepoError as e:
        status = e.response.status_code if e.response is not None else 401
        if status == 403:
            raise HubError(
                f"spec.model.path: the token has no access to the gated model {repo} on {url}: "
                f"request access at {url}/{repo}, or use a token of an account that has it "
                f"({_TOKEN_HOW})"
            ) from None
        raise HubError(
            f"spec.model.path: {repo} on {url} is gated and needs a token with access "
            f"({_TOKEN_HOW})"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"spec.model.path: no model {repo} on {url}: check the id (a private model also "
            f"needs a token: {_TOKEN_HOW})"
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"spec.model.path: {repo} has no revision {rev!r} on {url} (a branch, tag or "
            "40-hex commit)"
        ) from None
    except HfHubHTTPError as e:
        if e.response is not None and e.response.status_code == 401:
            raise HubError(
                f"spec.model.path: {url} refused the token for {repo} (invalid credentials): "
                f"check the token ({_TOKEN_HOW})"
            ) from None
        raise HubError(
            f"spec.model.path: cannot download {where} from {url} ({_short(e)}) and it is not in "
            f"the hub cache {cache}: retry later, pre-fill the cache, or set HF_ENDPOINT to a "
            "mirror"
        ) from None
    except Exception as e:
        if not (_is_network(e) or isinstance(e, LocalEntryNotFoundError)):
            raise
        raise HubError(
            f"spec.model.path: cannot download {where} from {url} ({_short(e)}) and it is not in "
            f"the hub cache {cache}: pre-fill the cache (`hf download {repo}` where the hub is "
            "reachable, with HF_HUB_CACHE pointing at it) or point spec.model.hub.endpoint (or "
            "HF_ENDPOINT) at a reachable mirror"
        ) from None
    if not any(path.glob("*.safetensors")):
        raise HubError(
            f"spec.model.path: {where} on {url} has no *.safetensors weights (the trainer and "
            "the engines read only safetensors): convert its weights (e.g. with transformers' "
            "save_pretrained) into a repo or folder of your own and point spec.model.path there"
        )
    return Snapshot(repo=repo, revision=path.name, path=path)


def cached(
    repo: str, *, revision: str | None = None, cache_dir: str | Path | None = None
) -> Snapshot | None:
    """The snapshot the cache holds for `revision` (a commit, or the branch or tag it last
    resolved to), without asking the hub; None when it holds none."""
    cache = _cache(cache_dir)
    try:
        path = _download(repo, revision or _DEFAULT_REVISION, cache, _endpoint(None), None, True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return Snapshot(repo=repo, revision=path.name, path=path)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _atomic_symlink(link: Path, target: str) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def fetch_pinned(
    repo: str,
    *,
    cache_dir: Path,
    pin: str,
    revision: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
) -> Snapshot:
    """`fetch` for the pods of one job sharing a cache volume: the first call records the commit
    it got (and the repo) in `<cache_dir>/lorarl/<pin>.revision` and later calls fetch that
    commit, whatever the branch says now; a later call for another repo is refused.
    `<cache_dir>/lorarl/<pin>` is a relative link to the snapshot, so a container that mounts
    the volume anywhere reads the model there."""
    if not _PIN_RE.match(pin):
        raise ValueError(f"pin {pin!r} must be a file name (letters, digits, '.', '_', '-')")
    cache = _cache(cache_dir)
    meta = cache / "lorarl"
    meta.mkdir(parents=True, exist_ok=True)
    pin_file = meta / f"{pin}.revision"
    with FileLock(str(meta / f"{pin}.lock")):
        if pin_file.exists():
            pinned, *rest = pin_file.read_text().split()
            if rest and rest[0] != repo:  # (a pin written before the repo was recorded: trusted)
                raise HubError(
                    f"spec.model.path: this job's pods pinned {rest[0]} at commit {pinned[:12]} "
                    f"and now ask for {repo}: a job's model cannot change once a pod has "
                    "loaded it; create a new job for another model"
                )
            snap = fetch(repo, revision=pinned, cache_dir=cache, endpoint=endpoint, token=token)
        else:
            snap = fetch(repo, revision=revision, cache_dir=cache, endpoint=endpoint, token=token)
            _atomic_write(pin_file, f"{snap.revision}\n{repo}\n")
        _atomic_symlink(meta / pin, os.path.relpath(snap.path, meta))
    return snap


def _write_termination_log(path: Path, text: str) -> None:
    """Kubernetes shows this file in the pod's status; outside a pod its folder is missing."""
    if path.parent.is_dir():
        with contextlib.suppress(OSError):
            path.write_text(text)


# huggingface_hub's HTTP client has no timeout of its own (file downloads and ETag checks do,
# repo info does not): a network that silently drops traffic would hold the pod in Init forever.
CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 20.0, 60.0


def _bounded(request: Any) -> None:  # an httpx2.Request
    """A request sent without a timeout (huggingface_hub passes None, which overrides a
    client's default) gets ours; one with its own keeps it."""
    timeout = request.extensions.get("timeout") or {}
    if all(value is None for value in timeout.values()):
        request.extensions["timeout"] = {
            "connect": CONNECT_TIMEOUT_S, "read": READ_TIMEOUT_S,
            "write": READ_TIMEOUT_S, "pool": READ_TIMEOUT_S,
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The init container's command: fetch a model into a shared cache volume, pinned."""
    hooks = get_session().event_hooks["request"]  # huggingface_hub 1.x+: an httpx client
    if _bounded not in hooks:
        hooks.append(_bounded)
    parser = argparse.ArgumentParser(
        prog="python -m lorarl.hub", description="Download a hub model into a pinned cache."
    )
    parser.add_argument("--repo", required=True, help="hub id, e.g. Qwen/Qwen2.5-3B-Instruct")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--cache", required=True, type=Path, help="the hub cache folder")
    parser.add_argument("--pin", required=True, help="the job's pin name under <cache>/lorarl/")
    parser.add_argument("--endpoint", default=None, help="the hub (default: HF_ENDPOINT)")
    parser.add_argument("--termination-log", type=Path, default=Path("/dev/termination-log"))
    args = parser.parse_args(argv)
    try:
        snap = fetch_pinned(
            args.repo,
            cache_dir=args.cache,
            pin=args.pin,
            revision=args.revision,
            endpoint=args.endpoint,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except HubError as e:
        print(str(e), file=sys.stderr)
        _write_termination_log(args.termination_log, str(e))
        return 1
    print(f"{snap.repo}@{snap.revision} at {args.cache / 'lorarl' / args.pin}", flush=True)
    _write_termination_log(args.termination_log, snap.revision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
