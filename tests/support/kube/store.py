"""The object store behind the emulator: the bookkeeping a real API server does on every write.

uid, a global monotonic resourceVersion, generation (bumped on changes outside metadata/status),
creationTimestamp, optimistic concurrency, the status subresource split, finalizer-gated deletion,
no-op writes that change nothing, and an event log that watches replay from a resourceVersion.
Thread-safe: HTTP handlers (emulator loop) and test helpers (test thread) write concurrently.
"""

from __future__ import annotations

import datetime as dt
import pickle
import random
import threading
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import errors
from .crds import VersionInfo

Obj = dict[str, Any]
Key = tuple[str, str, str | None, str]  # group, plural, namespace, name
# admit(operation, new, old) raises ApiError to deny: CREATE/UPDATE/DELETE, as a webhook would.
Admit = Callable[[str, Obj | None, Obj | None], None]

# What the API server fills in on create for built-ins whose status is otherwise the kubelet's.
_INITIAL_STATUS: dict[tuple[str, str], Obj] = {("", "pods"): {"phase": "Pending"}}
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the API server's generateName alphabet
LOG_SIZE = 20_000


def now_rfc3339() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Event:
    """One committed change. `old` is the previous state (None for ADDED)."""

    type: str  # ADDED | MODIFIED | DELETED
    key: Key
    obj: Obj
    old: Obj | None
    rv: int


def translate(event: Event, matches: Callable[[Obj], bool]) -> tuple[str, Obj] | None:
    """How a filtered watch sees an event: objects entering/leaving the filter are ADDED/DELETED."""
    if event.type == "DELETED":
        return ("DELETED", event.obj) if matches(event.obj) else None
    new_in = matches(event.obj)
    old_in = event.old is not None and matches(event.old)
    if new_in:
        return ("MODIFIED" if old_in else "ADDED", event.obj)
    return ("DELETED", event.obj) if old_in else None


@dataclass
class _Watcher:
    group: str
    plural: str
    namespace: str | None
    notify: Callable[[Event], None]


def _copy(value: Any) -> Any:
    """A deep copy of stored data (dicts, lists, strings, numbers: what JSON and YAML bodies
    hold): a pickle round trip gives the same result as `copy.deepcopy` for it at about a
    quarter of the CPU, and copies are most of what every read, write and watch event costs."""
    return pickle.loads(pickle.dumps(value, pickle.HIGHEST_PROTOCOL))


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        meta = obj["metadata"] = {}
    return meta


def _without(obj: Obj, *keys: str) -> Obj:
    return {k: v for k, v in obj.items() if k not in keys}


class Store:
    def __init__(self, log_size: int = LOG_SIZE) -> None:
        self._lock = threading.RLock()
        self._objects: dict[Key, Obj] = {}
        self._rv = 0
        self._log: deque[Event] = deque(maxlen=log_size)  # how far back watches can resume
        self._watchers: list[_Watcher] = []
        self.hooks: list[Callable[[Event], None]] = []  # called under the lock on every commit

    # -- reading -------------------------------------------------------------------------------
    @property
    def resource_version(self) -> str:
        with self._lock:
            return str(self._rv)

    def get(self, res: VersionInfo, namespace: str | None, name: str) -> Obj:
        with self._lock:
            return _copy(self._require(res, namespace, name))

    def find(self, res: VersionInfo, namespace: str | None, name: str) -> Obj | None:
        with self._lock:
            obj = self._objects.get(self._key(res, namespace, name))
            return _copy(obj) if obj is not None else None

    def list(
        self,
        res: VersionInfo,
        namespace: str | None,
        matches: Callable[[Obj], bool] = bool,
    ) -> tuple[list[Obj], str]:
        """Matching objects (all namespaces when `namespace` is None) and the list's RV."""
        with self._lock:
            items = [
                _copy(obj)
                for key, obj in self._objects.items()
                if key[:2] == (res.group, res.plural)
                and (namespace is None or key[2] == namespace)
                and matches(obj)
            ]
            return sorted(
                items, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"])
            ), str(self._rv)

    def all_objects(self) -> list[tuple[Key, Obj]]:
        with self._lock:
            return [(key, _copy(obj)) for key, obj in self._objects.items()]

    # -- writing -------------------------------------------------------------------------------
    def create(
        self,
        res: VersionInfo,
        namespace: str | None,
        body: Any,
        admit: Admit | None = None,
        owned: bool = False,
    ) -> Obj:
        """`owned`: the caller hands `body` over (a request body it parsed) and only reads the
        result (an HTTP reply), so neither is copied."""
        if not isinstance(body, dict):
            raise errors.bad_request(f"the body of a {res.kind} create must be a JSON object")
        obj = body if owned else _copy(body)
        meta = _meta(obj)
        self._check_kind(res, obj)
        namespace = self._check_namespace(res, namespace, meta.get("namespace"))
        with self._lock:
            name = meta.get("name") or self._generate_name(res, namespace, meta.get("generateName"))
            if self._key(res, namespace, name) in self._objects:
                raise errors.already_exists(res.group, res.plural, name)
            for field in (
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "selfLink",
                "managedFields",
                "resourceVersion",
            ):
                meta.pop(field, None)
            meta.update(
                name=name, uid=str(uuid.uuid4()), generation=1, creationTimestamp=now_rfc3339()
            )
            if namespace is not None:
                meta["namespace"] = namespace
            else:
                meta.pop("namespace", None)
            obj["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
            obj["kind"] = res.kind
            if res.status_subresource:
                obj.pop("status", None)  # status is written through /status only
                initial = _INITIAL_STATUS.get((res.group, res.plural))
                if initial is not None:
                    obj["status"] = _copy(initial)
            if admit is not None:
                admit("CREATE", _copy(obj), None)
            return self._commit("ADDED", self._key(res, namespace, name), obj, None, owned)

    def update(
        self,
        res: VersionInfo,
        namespace: str | None,
        name: str,
        mutate: Callable[[Obj], Any],
        *,
        subresource: str | None = None,
        admit: Admit | None = None,
        reply: bool = False,
    ) -> Obj:
        """Read-modify-write: `mutate` gets a copy of the stored object and returns the new one.
        `reply`: the caller only reads the result (an HTTP reply), so it is not copied.

        A resourceVersion left in the result must equal the stored one (else 409), so PUT bodies
        and patches that carry a stale one conflict, and patches without one apply on top.
        """
        with self._lock:
            key = self._key(res, namespace, name)
            old = self._require(res, namespace, name)
            cand = mutate(_copy(old))
            if not isinstance(cand, dict):
                raise errors.bad_request(f"the updated {res.kind} must be a JSON object")
            cand_meta = _meta(cand)
            wanted_rv = cand_meta.get("resourceVersion")
            if wanted_rv not in (None, "") and str(wanted_rv) != old["metadata"]["resourceVersion"]:
                raise errors.stale(res.group, res.plural, name)
            for field, actual in (("name", name), ("namespace", namespace)):
                given = cand_meta.get(field)
                checked = field == "name" or res.namespaced
                if checked and given not in (None, "") and given != actual:
                    raise errors.bad_request(
                        f"the {field} of the object ({given}) does not match "
                        f"the {field} on the URL ({actual})"
                    )
            new = self._split(res, old, cand, subresource)
            self._check_finalizers(res, old, new)
            if _without(new, "metadata") == _without(old, "metadata") and _without(
                new["metadata"], "resourceVersion"
            ) == _without(old["metadata"], "resourceVersion"):
                return _copy(old)  # a no-op write: no new resourceVersion, no event
            if _without(new, "metadata", "status") != _without(old, "metadata", "status"):
                new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
            if admit is not None:
                admit("UPDATE", _copy(new), _copy(old))
            released = new["metadata"].get("deletionTimestamp") and not new["metadata"].get(
                "finalizers"
            )
            return self._commit("DELETED" if released else "MODIFIED", key, new, old, reply)

    def delete(
        self,
        res: VersionInfo,
        namespace: str | None,
        name: str,
        preconditions: Mapping[str, Any] | None = None,
        admit: Admit | None = None,
    ) -> Obj:
        """Remove the object, or only mark it (deletionTimestamp) while finalizers remain."""
        with self._lock:
            key = self._key(res, namespace, name)
            old = self._require(res, namespace, name)
            meta = old["metadata"]
            for field in ("uid", "resourceVersion"):
                want = (preconditions or {}).get(field)
                if want and want != meta.get(field):
                    raise errors.conflict(
                        res.group,
                        res.plural,
                        name,
                        f"Precondition failed: {field} in precondition: {want}, "
                        f"{field} in object meta: {meta.get(field)}",
                    )
            if admit is not None:
                admit("DELETE", None, _copy(old))
            if meta.get("finalizers"):
                if meta.get("deletionTimestamp"):
                    return _copy(old)
                new = _copy(old)
                new["metadata"].update(
                    deletionTimestamp=now_rfc3339(), deletionGracePeriodSeconds=0
                )
                return self._commit("MODIFIED", key, new, old)
            return self._commit("DELETED", key, _copy(old), old)

    # -- watching ------------------------------------------------------------------------------
    def watch(
        self,
        res: VersionInfo,
        namespace: str | None,
        since: int | None,
        notify: Callable[[Event], None],
    ) -> tuple[list[Obj] | None, list[Event], str, Callable[[], None]]:
        """Subscribe atomically with a replay, so no event is lost or seen twice.

        `since=None`: the current objects (to send as ADDED) and then live events. Otherwise the
        logged events after `since`; a `since` older than the log is a 410 Gone.
        """
        watcher = _Watcher(res.group, res.plural, namespace, notify)
        with self._lock:
            initial: list[Obj] | None = None
            backlog: list[Event] = []
            if since is None:
                initial = [
                    _copy(o)
                    for k, o in self._objects.items()
                    if k[:2] == (res.group, res.plural) and (namespace is None or k[2] == namespace)
                ]
            else:
                floor = self._log[0].rv - 1 if len(self._log) == self._log.maxlen else 0
                if since < floor:
                    raise errors.ApiError(
                        410, "Expired", f"too old resource version: {since} ({floor})"
                    )
                backlog = [e for e in self._log if e.rv > since and self._concerns(watcher, e)]
            self._watchers.append(watcher)
            rv = self._rv

        def unsubscribe() -> None:
            with self._lock:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)

        return initial, backlog, str(rv), unsubscribe

    # -- internals -----------------------------------------------------------------------------
    @staticmethod
    def _key(res: VersionInfo, namespace: str | None, name: str) -> Key:
        return (res.group, res.plural, namespace if res.namespaced else None, name)

    def _require(self, res: VersionInfo, namespace: str | None, name: str) -> Obj:
        obj = self._objects.get(self._key(res, namespace, name))
        if obj is None:
            raise errors.not_found(res.group, res.plural, name)
        return obj

    @staticmethod
    def _concerns(watcher: _Watcher, event: Event) -> bool:
        group, plural, namespace, _ = event.key
        return (group, plural) == (watcher.group, watcher.plural) and (
            watcher.namespace is None or namespace == watcher.namespace
        )

    def _commit(self, kind: str, key: Key, new: Obj, old: Obj | None, shared: bool = False) -> Obj:
        """`shared`: return the event's copy (for a caller that only reads it)."""
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        if kind == "DELETED":
            del self._objects[key]
        else:
            self._objects[key] = new
        # `old` is the object the store just dropped (stored objects are never handed out nor
        # changed in place), and a deleted `new` is not kept: the event may take them as they are.
        event = Event(kind, key, new if kind == "DELETED" else _copy(new), old, self._rv)
        self._log.append(event)
        for watcher in list(self._watchers):
            if self._concerns(watcher, event):
                watcher.notify(event)
        for hook in self.hooks:
            hook(event)
        return event.obj if shared else _copy(new)

    def _generate_name(self, res: VersionInfo, namespace: str | None, prefix: Any) -> str:
        if not prefix:
            raise errors.invalid(
                res.group,
                res.plural,
                "",
                "metadata.name",
                "Required value: name or generateName is required",
            )
        while True:
            name = str(prefix) + "".join(random.choices(_GENERATE_ALPHABET, k=5))
            if self._key(res, namespace, name) not in self._objects:
                return name

    @staticmethod
    def _check_kind(res: VersionInfo, obj: Obj) -> None:
        kind = obj.get("kind")
        if kind not in (None, "", res.kind):
            raise errors.bad_request(
                f"the kind of the object ({kind}) does not match the "
                f"resource {errors.qualified(res.group, res.plural)} "
                f"({res.kind})"
            )

    @staticmethod
    def _check_namespace(res: VersionInfo, url_ns: str | None, body_ns: Any) -> str | None:
        if not res.namespaced:
            return None
        if url_ns is None:
            raise errors.bad_request(
                f"{res.kind} is namespaced: create it under /namespaces/<namespace>/{res.plural}"
            )
        if body_ns not in (None, "") and body_ns != url_ns:
            raise errors.bad_request(
                "the namespace of the provided object does not match the "
                "namespace sent on the request"
            )
        return url_ns

    @staticmethod
    def _split(res: VersionInfo, old: Obj, cand: Obj, subresource: str | None) -> Obj:
        """Keep what this endpoint may not change: other parts of the object, server metadata."""
        if subresource == "status":
            new = _copy(old)
            if "status" in cand:
                new["status"] = cand["status"]
            else:
                new.pop("status", None)
            return new
        new = cand
        if res.status_subresource:
            if "status" in old:
                new["status"] = _copy(old["status"])
            else:
                new.pop("status", None)
        old_meta, meta = old["metadata"], new["metadata"]
        for field in (
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "generation",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "resourceVersion",
        ):
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        for field in ("labels", "annotations", "finalizers", "ownerReferences"):
            if field in meta and meta[field] in (None, {}, []):
                del meta[field]
        return new

    @staticmethod
    def _check_finalizers(res: VersionInfo, old: Obj, new: Obj) -> None:
        if not old["metadata"].get("deletionTimestamp"):
            return
        added = set(new["metadata"].get("finalizers") or ()) - set(
            old["metadata"].get("finalizers") or ()
        )
        if added:
            raise errors.invalid(
                res.group,
                res.plural,
                old["metadata"]["name"],
                "metadata.finalizers",
                f"Forbidden: no new finalizers can be "
                f"added if the object is being deleted, found new finalizers "
                f"{sorted(added)}",
            )
