"""A local server that speaks the Hugging Face hub's HTTP protocol, for tests with no internet.

It serves model repos from folders to `huggingface_hub`'s own client (`model_info`,
`snapshot_download`, `hf_hub_download`), with what that client reads (pinned against
huggingface_hub 2.4.0 by tests/contract/test_hub_server.py):

- `GET /api/models/{repo}[/revision/{rev}]`: id, sha, siblings, gated, ...
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=`: the file listing snapshot_download uses
- `HEAD|GET /{repo}/resolve/{rev}/{path}`: the bytes, with `ETag`, `X-Repo-Commit`,
  `Content-Length` (and `X-Linked-Etag` / `X-Linked-Size` for LFS files); Xet is never
  advertised, so the client downloads over plain HTTP; `Range` is honoured (resumed downloads)
- errors as the hub sends them: `X-Error-Code` RepoNotFound / RevisionNotFound / EntryNotFound /
  GatedRepo with `X-Error-Message`, so the client raises its real exception types.

Each `publish` takes a copy of the folder's bytes as a new commit of the repo's `main` (shas are
40-hex, derived from the repo, the content and the parent), so a test can move the hub while a
client holds an older commit. Repos named in `tokens` are gated: their files need
`Authorization: Bearer <token>` (their metadata stays public, as on the hub).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qs, unquote, urlsplit

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
# What the hub stores in LFS: weights by extension, and any large file.
_LFS_SUFFIXES = {
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".h5",
    ".msgpack",
    ".onnx",
    ".gguf",
    ".ckpt",
}
_LFS_MIN_BYTES = 10 * 1024 * 1024
_LFS_POINTER_SIZE = 134
_DEFAULT_BRANCH = "main"
_NOT_FOUND = "Sorry, we can't find the page you are looking for."


@dataclass(frozen=True)
class _File:
    data: bytes
    blob_id: str  # git's blob sha1, the hub's `oid`
    sha256: str
    lfs: bool

    @classmethod
    def of(cls, path: str, data: bytes) -> _File:
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        lfs = Path(path).suffix in _LFS_SUFFIXES or len(data) >= _LFS_MIN_BYTES
        return cls(data, blob, hashlib.sha256(data).hexdigest(), lfs)

    @property
    def etag(self) -> str:
        """The hub's ETag: the LFS sha256 for LFS files, the git blob id otherwise."""
        return self.sha256 if self.lfs else self.blob_id


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: dict[str, _File]
    time: float


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class HubServer:
    """Serve `repos` (repo id -> folder) over the hub's protocol; a context manager with `.url`."""

    def __init__(
        self,
        repos: dict[str, Path],
        tokens: dict[str, str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.tokens = dict(tokens or {})
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._commits: dict[str, dict[str, _Commit]] = {}
        self._branches: dict[str, dict[str, str]] = {}
        # (kind, repo, path) for each request; kind: info | tree | head | get
        self.requests: list[tuple[str, str, str]] = []
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()  # open keep-alive connections
        self._thread: threading.Thread | None = None
        for repo, folder in repos.items():
            self.publish(repo, folder)

    # --- the hub's state ---------------------------------------------------------------------

    def publish(self, repo: str, folder: Path) -> str:
        """Commit a copy of `folder`'s files as the new head of `repo`'s main branch; its sha."""
        folder = Path(folder)
        files = {
            p.relative_to(folder).as_posix(): _File.of(p.name, p.read_bytes())
            for p in sorted(folder.rglob("*"))
            if p.is_file() and ".git" not in p.relative_to(folder).parts
        }
        with self._lock:
            parent = self._branches.get(repo, {}).get(_DEFAULT_BRANCH, "")
            tree = "".join(f"{path} {f.blob_id}\n" for path, f in sorted(files.items()))
            sha = hashlib.sha1(f"repo {repo}\nparent {parent}\n{tree}".encode()).hexdigest()
            self._commits.setdefault(repo, {})[sha] = _Commit(sha, files, time.time())
            self._branches.setdefault(repo, {})[_DEFAULT_BRANCH] = sha
        return sha

    def sha(self, repo: str, branch: str = _DEFAULT_BRANCH) -> str:
        """The commit `branch` of `repo` points at now."""
        with self._lock:
            return self._branches[repo][branch]

    def count(self, kind: str, path: str | None = None, repo: str | None = None) -> int:
        """How many requests of `kind` (info, tree, head, get) were served, optionally for one
        file `path` / one `repo` (errors included)."""
        with self._lock:
            return sum(
                1
                for k, r, p in self.requests
                if k == kind and (path is None or p == path) and (repo is None or r == repo)
            )

    def counts(self) -> Counter[str]:
        """Requests served by kind."""
        with self._lock:
            return Counter(k for k, _, _ in self.requests)

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the hub server is not running")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """Where this machine reaches it (a server on 0.0.0.0 is reached on 127.0.0.1 here)."""
        host = "127.0.0.1" if self._host in ("0.0.0.0", "") else self._host
        return f"http://{host}:{self.port}"

    def start(self) -> HubServer:
        self._server = ThreadingHTTPServer((self._host, self._port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: close the port and the clients' keep-alive connections, so that the
        next request fails as against a hub that went away (not served by a pooled connection)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- the protocol -------------------------------------------------------------------------

    def _record(self, kind: str, repo: str, path: str) -> None:
        with self._lock:
            self.requests.append((kind, repo, path))

    def _split_repo(self, rest: str) -> tuple[str, str]:
        """(repo, what follows it) for a URL path that starts with a repo id."""
        with self._lock:
            known = sorted(self._commits, key=len, reverse=True)
        for repo in known:
            if rest == repo or rest.startswith(repo + "/"):
                return repo, rest[len(repo) + 1 :]
        # Unknown: the id is everything before the route's keyword, as the hub reads it.
        for keyword in ("/revision/", "/tree/", "/resolve/"):
            if keyword in rest:
                return rest.split(keyword, 1)[0], ""
        return rest, ""

    def _commit(self, repo: str, revision: str, authed: bool) -> _Commit:
        with self._lock:
            commits = self._commits.get(repo)
            branches = self._branches.get(repo, {})
            if commits is None:
                # 401 to anonymous callers, so a private repo's existence stays hidden (as the hub)
                raise _HubError(401 if not authed else 404, "RepoNotFound", "Repository not found")
            sha = branches.get(revision, revision)
            if sha not in commits:
                raise _HubError(404, "RevisionNotFound", "Invalid rev id: " + revision)
            return commits[sha]

    def _check_token(self, repo: str, authorization: str | None) -> None:
        token = self.tokens.get(repo)
        if token is None:
            return
        if authorization is None:
            raise _HubError(
                401,
                "GatedRepo",
                f"Access to model {repo} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in.",
            )
        if authorization != f"Bearer {token}":
            raise _HubError(
                403,
                "GatedRepo",
                f"Access to model {repo} is restricted and you are not in the authorized list. "
                f"Visit {self.url}/{repo} to ask for access.",
            )

    def _info(self, repo: str, commit: _Commit, blobs: bool) -> dict[str, object]:
        when = datetime.fromtimestamp(commit.time, UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
        siblings: list[dict[str, object]] = []
        for path, f in sorted(commit.files.items()):
            sibling: dict[str, object] = {"rfilename": path}
            if blobs:
                sibling.update(size=len(f.data), blobId=f.blob_id)
                if f.lfs:
                    lfs = {
                        "size": len(f.data),
                        "sha256": f.sha256,
                        "pointerSize": _LFS_POINTER_SIZE,
                    }
                    sibling["lfs"] = lfs
            siblings.append(sibling)
        return {
            "_id": hashlib.sha1(repo.encode()).hexdigest()[:24],
            "id": repo,
            "modelId": repo,
            "author": repo.split("/")[0] if "/" in repo else None,
            "sha": commit.sha,
            "lastModified": when,
            "createdAt": when,
            "private": False,
            "gated": "manual" if repo in self.tokens else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["transformers", "safetensors"],
            "library_name": "transformers",
            "siblings": siblings,
            "usedStorage": sum(len(f.data) for f in commit.files.values()),
        }

    @staticmethod
    def _tree(commit: _Commit, under: str, recursive: bool) -> list[dict[str, object]]:
        prefix = under.strip("/") + "/" if under.strip("/") else ""
        entries: dict[str, dict[str, object]] = {}
        for path, f in sorted(commit.files.items()):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix) :].split("/")
            # The folders on the way, as the hub lists them (type "directory").
            for depth in range(1, len(parts)):
                if depth > 1 and not recursive:
                    break
                folder = prefix + "/".join(parts[:depth])
                oid = hashlib.sha1(folder.encode()).hexdigest()
                entries.setdefault(
                    folder, {"type": "directory", "oid": oid, "size": 0, "path": folder}
                )
            if len(parts) > 1 and not recursive:
                continue
            entry: dict[str, object] = {
                "type": "file",
                "oid": f.blob_id,
                "size": len(f.data),
                "path": path,
            }
            if f.lfs:
                entry["lfs"] = {
                    "oid": f.sha256,
                    "size": len(f.data),
                    "pointerSize": _LFS_POINTER_SIZE,
                }
            entries[path] = entry
        if prefix and not entries:
            raise _HubError(
                404, "EntryNotFound", f"{under} does not exist on {commit.sha}", commit.sha
            )
        return list(entries.values())

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with hub._lock:
                    hub._connections.add(self.connection)

            def finish(self) -> None:
                with hub._lock:
                    hub._connections.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:
                self._serve(head=False)

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def _serve(self, head: bool) -> None:
                url = urlsplit(self.path)
                path = unquote(url.path)
                query = parse_qs(url.query)
                authorization = self.headers.get("Authorization")
                kind, repo, file = "other", "", ""
                try:
                    if path.startswith("/api/models/") and not head:
                        repo, rest = hub._split_repo(path[len("/api/models/") :])
                        if rest.startswith("tree/"):
                            kind = "tree"
                            revision, _, under = rest[len("tree/") :].partition("/")
                            hub._record(kind, repo, under)
                            commit = hub._commit(repo, revision, authorization is not None)
                            recursive = query.get("recursive", ["false"])[0].lower() == "true"
                            self._json(200, hub._tree(commit, under, recursive), commit.sha, head)
                            return
                        if rest.startswith("revision/"):
                            revision = rest[len("revision/") :]
                        elif rest == "":
                            revision = _DEFAULT_BRANCH
                        else:
                            raise _HubError(404, None, _NOT_FOUND)
                        kind = "info"
                        hub._record(kind, repo, "")
                        commit = hub._commit(repo, revision, authorization is not None)
                        blobs = query.get("blobs", ["false"])[0].lower() == "true"
                        self._json(200, hub._info(repo, commit, blobs), commit.sha, head)
                        return
                    if "/resolve/" in path:
                        kind = "head" if head else "get"
                        repo, rest = hub._split_repo(path.lstrip("/"))
                        if not rest.startswith("resolve/"):
                            repo, _, rest = path.lstrip("/").partition("/resolve/")
                            rest = "resolve/" + rest
                        revision, _, file = rest[len("resolve/") :].partition("/")
                        hub._record(kind, repo, file)
                        commit = hub._commit(repo, revision, authorization is not None)
                        hub._check_token(repo, authorization)
                        if file not in commit.files:
                            raise _HubError(
                                404,
                                "EntryNotFound",
                                f"{file} does not exist on {revision}",
                                commit.sha,
                            )
                        self._file(commit, commit.files[file], head)
                        return
                    hub._record(kind, repo, path)
                    raise _HubError(404, None, _NOT_FOUND)
                except _HubError as e:
                    self._error(e, head)

            def _json(self, status: int, body: object, commit: str | None, head: bool) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                if commit is not None:
                    self.send_header("X-Repo-Commit", commit)
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _error(self, e: _HubError, head: bool) -> None:
                data = json.dumps({"error": e.message}).encode()
                self.send_response(e.status)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                if e.code is not None:
                    self.send_header("X-Error-Code", e.code)
                self.send_header("X-Error-Message", e.message)
                if e.commit is not None:
                    self.send_header("X-Repo-Commit", e.commit)
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _file(self, commit: _Commit, f: _File, head: bool) -> None:
                data, status = f.data, 200
                start, end = 0, len(f.data) - 1
                ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if ranged and len(f.data):
                    start = int(ranged.group(1))
                    end = min(int(ranged.group(2) or end), end)
                    data, status = f.data[start : end + 1], 206
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{f.etag}"')
                self.send_header("X-Repo-Commit", commit.sha)
                if f.lfs:
                    self.send_header("X-Linked-Etag", f'"{f.sha256}"')
                    self.send_header("X-Linked-Size", str(len(f.data)))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(f.data)}")
                self.end_headers()
                if not head:
                    self.wfile.write(data)

        return Handler
