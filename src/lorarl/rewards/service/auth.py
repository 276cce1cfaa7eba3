"""The reward service's key: who holds it, how it is sent, how the service checks it.

A per-job key of its own, `LORARL_REWARD_API_KEY` (a third key, `reward-key`, in the job's Secret;
generated per run locally), given to the reward service and to the trainer, its only client. It is
not the engine key: the reward service runs untrusted code (`python_tests`), and the engine key
lets its holder generate on the engines and load, unload or (vLLM's dev-mode `/collective_rpc`)
rewrite the weights they serve. The reward key only lets its holder ask for scores, which the
reward pod computes anyway. It is never the sync key either (`lorarl.sync.protocol`).

The trainer sends it as `Authorization: Bearer <key>`; the service compares it in constant time
(both sides hashed first, so not even the length leaks) and answers 401 otherwise. `GET /healthz`
stays open (probes and the trainer's readiness wait carry no key). A service started without a
key refuses to start: it never serves unauthenticated.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "OPEN_PATHS",
    "REWARD_API_KEY_ENV",
    "REWARD_KEY_CONTAINERS",
    "BearerAuth",
    "RewardKeyMissing",
    "authorization_header",
    "service_key",
]

REWARD_API_KEY_ENV = "LORARL_REWARD_API_KEY"
# The containers (and colocated processes) that get the reward key: the service and its client.
REWARD_KEY_CONTAINERS = ("trainer", "reward")
OPEN_PATHS = frozenset({"/healthz"})  # GET and HEAD only
_READS = frozenset({"GET", "HEAD"})


class RewardKeyMissing(RuntimeError):
    """The reward service was started without its key."""


def service_key(env: Mapping[str, str]) -> str:
    """The key the service checks, from its environment (never its command line)."""
    key = env.get(REWARD_API_KEY_ENV, "")
    if not key:
        raise RewardKeyMissing(
            f"{REWARD_API_KEY_ENV} is not set: the reward service only answers requests that carry "
            "the job's reward key, and will not start without one (the operator gives it from the "
            "job's Secret, `lorarl run --local` generates one; when you start it yourself, export "
            "a random value and give the trainer the same)"
        )
    _check_header_safe(key)
    return key


def authorization_header(key: str) -> dict[str, str]:
    _check_header_safe(key)
    return {"Authorization": f"Bearer {key}"}


def _check_header_safe(key: str) -> None:
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{REWARD_API_KEY_ENV} must be printable ASCII without spaces")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


def bearer_matches(headers: Iterable[tuple[bytes, bytes]], key_digest: bytes) -> bool:
    """Whether the ASGI headers hold exactly one `Authorization: Bearer <key>` with our key."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return False
    scheme, _, token = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(_digest(token.strip()), key_digest)


class BearerAuth:
    """ASGI middleware: every request but a GET/HEAD of `OPEN_PATHS` needs the key, checked
    before the route (and before any of the body is read)."""

    def __init__(self, app: Any, *, key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        if not key:
            raise RewardKeyMissing("BearerAuth needs a non-empty key")
        self.app = app
        self.key_digest = _digest(key.encode())
        self.open_paths = open_paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root not in ("", "/") and path.startswith(root):  # Starlette's paths include it
            path = path[len(root) :] or "/"
        if scope["type"] == "http" and path in self.open_paths and scope["method"] in _READS:
            await self.app(scope, receive, send)
            return
        if bearer_matches(scope.get("headers", ()), self.key_digest):
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # a websocket: close it before accepting
            await send({"type": "websocket.close", "code": 1008})
            return
        body = b'{"detail":"missing or wrong reward key (Authorization: Bearer ...)"}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="lorarl-reward"'),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
