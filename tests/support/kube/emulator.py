"""`KubeEmulator`: kmock's KubernetesEmulator with the semantics a real API server has.

kmock 0.8 stores objects loosely (no uid/resourceVersion, 200 on create, no status split, ...).
This subclass keeps kmock's HTTP server, request parsing, `resources` registry, `objects` view
(mirrored from the store, with history) and its DSL (reactions added with ``emulator[...] << ...``
still win, for fault injection), and serves everything else from `Store`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.resources
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal.rendering import StreamingError

from . import admission, discovery, errors, jsonpath, patches, paths, selectors, tables
from .crds import PrinterColumn, ScalePaths, VersionInfo, parse_crd
from .helpers import TestHelpers
from .store import Event, Obj, Store, now_rfc3339, translate

ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
CRD_GROUP, CRD_PLURAL = "apiextensions.k8s.io", "customresourcedefinitions"
_BUILTIN_COLUMNS: dict[tuple[str, str], tuple[PrinterColumn, ...]] = {
    ("", "pods"): (PrinterColumn("Status", "string", ".status.phase"), tables.AGE_COLUMN),
}

ResourceRef = str | tuple[str, str, str] | kmock.resource


@functools.lru_cache(maxsize=1024)
def _resource(group: str | None, version: str | None, plural: str | None) -> kmock.resource:
    """kmock's (frozen) key for a resource, built once: its constructor's typing checks cost
    ~18 us, and every request and commit looks one up."""
    return kmock.resource(group, version, plural)


def _json(body: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.json_response(body, status=status)


def _not_served(path: str) -> errors.ApiError:
    return errors.ApiError(
        404, "NotFound", f"the server could not find the requested resource ({path})"
    )


def _set_path(obj: Obj, path: str, value: Any) -> None:
    """Write at a simple `.a.b.c` path (what CRD scale paths are), creating dicts on the way."""
    keys = [k for k in path.split(".") if k]
    cur = obj
    for key in keys[:-1]:
        cur = cur.setdefault(key, {})
    cur[keys[-1]] = value


async def _parse_request(raw: aiohttp.web.BaseRequest, request_id: int) -> kmock.Request:
    """A kmock Request whose Kubernetes fields (resource, namespace, name, action) are right."""
    body = await raw.read()
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text) if text.strip() else None
    except ValueError:
        data = None
    method = raw.method.upper()
    parsed = paths.parse(raw.path)
    fields: dict[str, Any] = {}
    if isinstance(parsed, paths.ApiPath):
        watch = raw.query.get("watch") in ("true", "1")
        action = {
            "GET": kmock.action.WATCH
            if watch
            else kmock.action.FETCH
            if parsed.name
            else kmock.action.LIST,
            "POST": kmock.action.CREATE,
            "PUT": kmock.action.UPDATE,
            "PATCH": kmock.action.UPDATE,
            "DELETE": kmock.action.DELETE,
        }.get(method)
        fields = {
            "action": action,
            "namespace": parsed.namespace,
            "name": parsed.name,
            "subresource": parsed.subresource,
            "resource": _resource(parsed.group, parsed.version, parsed.plural),
        }
    return kmock.Request(
        id=request_id,
        raw_request=raw,
        url=raw.url,
        method=raw.method,
        params=dict(raw.query),
        headers=dict(raw.headers),
        cookies=dict(raw.cookies),
        body=body,
        text=text,
        data=data,
        **fields,
    )


@attrs.define(kw_only=True)
class KubeEmulator(TestHelpers, kmock.KubernetesEmulator):
    store: Store = attrs.field(factory=Store)
    server_version: str = "v1.37.0"
    builtins: bool = True  # serve kmock's bundled built-in resources (pods, events, ...)
    _crd_versions: dict[tuple[str, str, str], VersionInfo] = attrs.field(factory=dict, init=False)
    _admission_rules: list[admission.AdmissionRule] = attrs.field(factory=list, init=False)
    _watch_queues: set[asyncio.Queue[Event | None]] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        # Deliberately not super(): kmock's loose fallback reactions are replaced by _serve().
        if self.builtins:  # kmock's load_bundled() uses a deprecated importlib API
            self.resources.load_path(
                str(importlib.resources.files("kmock._internal") / "resources.json.gz")
            )
        self.store.hooks.append(self._on_commit)
        if self.builtins:
            self.create("v1/namespaces", {"metadata": {"name": "default"}})

    # -- HTTP entry ----------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point, with requests parsed by `paths` (kmock 0.8 fails on some URLs)."""
        request = await _parse_request(raw_request, len(self._requests))
        self._requests.append(request)
        try:
            return await self._handle(request)
        except StreamingError as exc:  # a test's streaming reaction failed mid-stream
            if self._errors:
                self._errors[-1].append(exc.__cause__ or exc)
            response = exc.args[0]
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self._stream_error(exc.__cause__ or exc, response)
                await response.write_eof()
            return response
        except Exception as exc:  # an emulator bug or a failing reaction: a 500 Status, recorded
            if self._errors:
                self._errors[-1].append(exc)
            return await self._render_error(exc)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if self._payloads:  # reactions declared by a test take precedence
            try:
                return await kmock.RawHandler._handle(self, request)
            except NotImplementedError:
                pass
        try:
            return await self._route(request)
        except errors.ApiError as exc:
            return _json(exc.status(), status=exc.code)

    async def _route(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path
        method = str(request.method.value).upper()
        if path.rstrip("/") == "/version":
            return _json(self._version_doc())
        parsed = paths.parse(path)
        if isinstance(parsed, paths.DiscoveryPath):
            if method != "GET":
                raise errors.method_not_allowed(f"{method} is not allowed on {path}")
            return _json(self._discovery(parsed, request))
        if parsed is None:
            raise _not_served(path)
        return await self._serve_resource(request, method, parsed)

    def _version_doc(self) -> dict[str, Any]:
        major, minor = self.server_version.lstrip("v").split(".")[:2]
        return {
            "major": major,
            "minor": minor,
            "gitVersion": self.server_version,
            "gitCommit": "kube-emulator",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    def _discovery(self, p: paths.DiscoveryPath, request: kmock.Request) -> dict[str, Any]:
        infos = self.served()
        doc: dict[str, Any] | None
        if p.group is None:
            host = request.url.host or "127.0.0.1"
            doc = (
                discovery.api_versions(f"{host}:{request.url.port}")
                if p.legacy
                else discovery.api_group_list(infos)
            )
        elif p.version is None:
            doc = discovery.api_group(p.group, infos)
        else:
            verbs = {(i.group, i.version, i.plural): self._verbs(i) for i in infos}
            doc = discovery.resource_list(p.group, p.version, infos, verbs)
        if doc is None:
            raise _not_served(request.url.path)
        return doc

    # -- resources -----------------------------------------------------------------------------
    async def _serve_resource(
        self,
        request: kmock.Request,
        method: str,
        p: paths.ApiPath,
    ) -> aiohttp.web.StreamResponse:
        info = self._info(p.group, p.version, p.plural)
        sub = p.subresource
        if (
            info is None
            or (p.namespace is not None and not info.namespaced)
            or (
                sub not in (None, "status", "scale")
                or (sub == "status" and not info.status_subresource)
                or (sub == "scale" and info.scale is None)
                or (sub is not None and p.name is None)
            )
        ):
            raise _not_served(request.url.path)
        ns = p.namespace if info.namespaced else None
        if method != "GET" and request.params.get("dryRun"):
            raise errors.bad_request("dryRun is not emulated: the write would be committed")
        if method == "GET":
            if request.params.get("watch") in ("true", "1"):
                return await self._watch(request, info, p)
            if p.name is None:
                return self._list_response(request, info, ns)
            obj = self.store.get(info, ns, p.name)
            if sub == "scale":
                return _json(self._scale_of(info, obj))
            if tables.wants_table(self._header(request, "Accept")):
                return _json(self._table(request, info, [obj], self.store.resource_version))
            return _json(self._present(info, obj))
        if method == "POST":
            if p.name is not None:
                raise errors.method_not_allowed(f"POST is not allowed on {request.url.path}")
            body = self._body(request)
            if (info.group, info.plural) == (CRD_GROUP, CRD_PLURAL):
                self._validate_crd(body)
            obj = self.store.create(info, ns, body, admit=self._admit(info, ns, None), owned=True)
            obj = self._after_write(info, obj)
            return _json(self._present(info, obj), status=201)
        if method in ("PUT", "PATCH"):
            if p.name is None:
                raise errors.method_not_allowed(f"{method} needs an object name in the URL")
            body = self._body(request)
            if sub == "scale":
                return _json(self._write_scale(request, method, info, p.name, ns, body))
            obj = self.store.update(
                info,
                ns,
                p.name,
                self._mutation(request, method, info, body),
                subresource=sub,
                admit=self._admit(info, ns, sub),
                reply=True,
            )
            return _json(self._present(info, self._after_write(info, obj)))
        if method == "DELETE":
            if sub is not None:
                raise errors.method_not_allowed(f"DELETE is not allowed on {request.url.path}")
            options = self._body(request, required=False) or {}
            if p.name is None:
                return self._delete_collection(request, info, ns, options)
            obj = self.store.delete(
                info,
                ns,
                p.name,
                preconditions=options.get("preconditions"),
                admit=self._admit(info, ns, None),
            )
            return _json(self._present(info, obj))
        raise errors.method_not_allowed(f"{method} is not allowed on {request.url.path}")

    def _mutation(
        self,
        request: kmock.Request,
        method: str,
        info: VersionInfo,
        body: Any,
    ) -> Callable[[Obj], Any]:
        if method == "PUT":
            return lambda old: body
        content_type = self._header(request, "Content-Type") or ""
        is_custom = (info.group, info.version, info.plural) in self._crd_versions
        if is_custom and patches.STRATEGIC_PATCH in content_type:
            raise errors.ApiError(
                415,
                "UnsupportedMediaType",
                "strategic merge patch is not "
                "supported for custom resources; use a merge or JSON patch",
            )
        return lambda old: patches.apply_patch(content_type, old, body)

    def _list_response(
        self,
        request: kmock.Request,
        info: VersionInfo,
        ns: str | None,
    ) -> aiohttp.web.Response:
        items, rv = self.store.list(info, ns, self._filter(request, info, None))
        if tables.wants_table(self._header(request, "Accept")):
            return _json(self._table(request, info, items, rv))
        return _json(
            {
                "kind": info.list_kind,
                "apiVersion": self._gv(info),
                "metadata": {"resourceVersion": rv},
                "items": [self._present(info, o) for o in items],
            }
        )

    def _table(
        self, request: kmock.Request, info: VersionInfo, items: list[Obj], rv: str
    ) -> dict[str, Any]:
        include = request.params.get("includeObject", "Metadata")
        return tables.render_table(
            [self._present(info, o) for o in items], info.printer_columns, rv, include
        )

    def _delete_collection(
        self,
        request: kmock.Request,
        info: VersionInfo,
        ns: str | None,
        options: Mapping[str, Any],
    ) -> aiohttp.web.Response:
        items, _ = self.store.list(info, ns, self._filter(request, info, None))
        deleted = []
        for obj in items:
            meta = obj["metadata"]
            with contextlib.suppress(errors.ApiError):
                deleted.append(
                    self._present(
                        info,
                        self.store.delete(
                            info,
                            meta.get("namespace"),
                            meta["name"],
                            admit=self._admit(info, meta.get("namespace"), None),
                        ),
                    )
                )
        return _json(
            {
                "kind": info.list_kind,
                "apiVersion": self._gv(info),
                "metadata": {"resourceVersion": self.store.resource_version},
                "items": deleted,
            }
        )

    # -- watch ---------------------------------------------------------------------------------
    async def _watch(
        self,
        request: kmock.Request,
        info: VersionInfo,
        p: paths.ApiPath,
    ) -> aiohttp.web.StreamResponse:
        params = request.params
        matches = self._filter(request, info, p.name)
        initial_events = params.get("sendInitialEvents") == "true"
        rv_param = params.get("resourceVersion") or ""
        try:
            since = None if rv_param in ("", "0") or initial_events else int(rv_param)
            timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        except ValueError as exc:
            raise errors.bad_request(f"invalid watch parameter: {exc}") from exc
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        ns = p.namespace if info.namespaced else None
        try:
            initial, backlog, rv, unsubscribe = self.store.watch(
                info, ns, since, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev)
            )
        except errors.ApiError as exc:  # 410 Gone arrives as an ERROR event on a 200 stream
            await response.prepare(raw)
            await self._send(response, "ERROR", exc.status())
            await response.write_eof()
            return response
        self._watch_queues.add(queue)
        try:
            await response.prepare(raw)
            for obj in initial or ():
                if matches(obj):
                    await self._send(response, "ADDED", self._present(info, obj))
            if initial_events:
                await self._send(
                    response,
                    "BOOKMARK",
                    {
                        "kind": info.kind,
                        "apiVersion": self._gv(info),
                        "metadata": {
                            "resourceVersion": rv,
                            "annotations": {"k8s.io/initial-events-end": "true"},
                        },
                    },
                )
            for event in backlog:
                if seen := translate(event, matches):
                    await self._send(response, seen[0], self._present(info, seen[1]))
            deadline = loop.time() + timeout if timeout is not None else None
            while True:
                wait = 1.0 if deadline is None else min(1.0, deadline - loop.time())
                if wait <= 0:
                    break
                try:
                    event = await asyncio.wait_for(queue.get(), wait)
                except TimeoutError:
                    if raw.transport is None or raw.transport.is_closing():
                        break  # the client went away
                    continue
                if event is None:
                    break  # the emulator is shutting down
                if seen := translate(event, matches):
                    await self._send(response, seen[0], self._present(info, seen[1]))
        except ConnectionError:
            pass
        finally:
            unsubscribe()
            self._watch_queues.discard(queue)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        return response

    @staticmethod
    async def _send(response: aiohttp.web.StreamResponse, kind: str, obj: Obj) -> None:
        await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

    async def close_watches(self) -> None:
        """End every open watch stream (at shutdown; clients see a normal end and reconnect)."""
        for queue in list(self._watch_queues):
            queue.put_nowait(None)

    # -- scale ---------------------------------------------------------------------------------
    def _scale_of(self, info: VersionInfo, obj: Obj) -> Obj:
        assert info.scale is not None
        spec = jsonpath.find(obj, info.scale.spec_replicas)
        status = jsonpath.find(obj, info.scale.status_replicas)
        meta = obj["metadata"]
        doc: Obj = {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": spec[0] if spec else 0},
            "status": {"replicas": status[0] if status else 0},
        }
        if info.scale.label_selector:
            selector = jsonpath.find(obj, info.scale.label_selector)
            if selector and isinstance(selector[0], str):
                doc["status"]["selector"] = selector[0]
        return doc

    def _write_scale(
        self,
        request: kmock.Request,
        method: str,
        info: VersionInfo,
        name: str,
        ns: str | None,
        body: Any,
    ) -> Obj:
        assert info.scale is not None
        spec_path = info.scale.spec_replicas
        content_type = self._header(request, "Content-Type") or ""

        def mutate(old: Obj) -> Obj:
            scale = self._scale_of(info, old)
            new = body if method == "PUT" else patches.apply_patch(content_type, scale, body)
            replicas = ((new if isinstance(new, dict) else {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
                raise errors.invalid(
                    info.group,
                    info.plural,
                    name,
                    "spec.replicas",
                    f"Invalid value: {replicas!r}: must be a non-negative integer",
                )
            _set_path(old, spec_path, replicas)
            wanted_rv = (new.get("metadata") or {}).get("resourceVersion")
            if wanted_rv:
                old["metadata"]["resourceVersion"] = wanted_rv  # a stale one conflicts
            return old

        obj = self.store.update(info, ns, name, mutate, admit=self._admit(info, ns, "scale"))
        return self._scale_of(info, obj)

    # -- CRDs ----------------------------------------------------------------------------------
    def add_crd(self, manifest: Mapping[str, Any]) -> list[VersionInfo]:
        """Serve a CRD-backed resource from its manifest (as `kubectl apply -f crd.yaml` would).
        A malformed manifest is a ValueError naming the field."""
        versions = parse_crd(manifest)
        crd_info = self.resolve((CRD_GROUP, "v1", CRD_PLURAL))
        name = manifest["metadata"]["name"]
        if self.store.find(crd_info, None, name) is None:
            obj = self.store.create(crd_info, None, dict(manifest))
        else:
            obj = self.store.update(
                crd_info,
                None,
                name,
                lambda old: {
                    **dict(manifest),
                    "metadata": {**old["metadata"], **manifest["metadata"]},
                },
            )
        self._after_write(crd_info, obj)
        return versions

    @staticmethod
    def _validate_crd(manifest: Any) -> list[VersionInfo]:
        try:
            return parse_crd(manifest if isinstance(manifest, Mapping) else {})
        except ValueError as exc:
            name = (
                ((manifest or {}).get("metadata") or {}).get("name", "")
                if isinstance(manifest, Mapping)
                else ""
            )
            raise errors.invalid(CRD_GROUP, CRD_PLURAL, name, "spec", str(exc)) from exc

    def _after_write(self, info: VersionInfo, obj: Obj) -> Obj:
        """A written CRD becomes served and Established, like the apiextensions controller does."""
        if (info.group, info.plural) != (CRD_GROUP, CRD_PLURAL) or obj["metadata"].get(
            "deletionTimestamp"
        ):
            return obj
        try:
            versions = parse_crd(obj)
        except ValueError:
            return obj
        for v in versions:
            self._crd_versions[(v.group, v.version, v.plural)] = v
            self.resources[kmock.resource(v.group, v.version, v.plural)] = kmock.ResourceInfo(
                kind=v.kind,
                singular=v.singular,
                namespaced=v.namespaced,
                verbs=ALL_VERBS,
                shortnames=v.short_names,
                categories=v.categories,
                subresources={
                    s
                    for s, on in (("status", v.status_subresource), ("scale", v.scale is not None))
                    if on
                },
            )
        names = obj["spec"]["names"]
        conditions = [
            {
                "type": t,
                "status": "True",
                "reason": r,
                "message": "",
                "lastTransitionTime": now_rfc3339(),
            }
            for t, r in (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))
        ]
        status = {
            "conditions": conditions,
            "acceptedNames": names,
            "storedVersions": [v.version for v in versions if v.storage],
        }
        return self.store.update(
            info,
            None,
            obj["metadata"]["name"],
            lambda old: {**old, "status": status},
            subresource="status",
        )

    # -- resource registry ---------------------------------------------------------------------
    def _info(self, group: str, version: str, plural: str) -> VersionInfo | None:
        key = (group, version, plural)
        if key in self._crd_versions:
            return self._crd_versions[key]
        res = _resource(group, version, plural)
        if res not in self.resources:
            return None
        ri = self.resources[res]
        kind = ri.kind or plural.capitalize()
        return VersionInfo(
            group=group,
            version=version,
            plural=plural,
            singular=ri.singular or kind.lower(),
            kind=kind,
            list_kind=f"{kind}List",
            namespaced=ri.namespaced is not False,
            short_names=tuple(sorted(ri.shortnames)),
            categories=tuple(sorted(ri.categories)),
            status_subresource="status" in ri.subresources,
            scale=ScalePaths(label_selector=".status.selector")
            if "scale" in ri.subresources
            else None,
            printer_columns=_BUILTIN_COLUMNS.get((group, plural), ()),
        )

    def served(self) -> list[VersionInfo]:
        """Every resource the discovery endpoints list."""
        result = []
        for res in list(self.resources):
            if res.group is not None and res.version and res.plural:
                info = self._info(res.group, res.version, res.plural)
                if info is not None:
                    result.append(info)
        return result

    def _verbs(self, info: VersionInfo) -> list[str]:
        res = _resource(info.group, info.version, info.plural)
        return sorted(self.resources[res].verbs) or ALL_VERBS

    def resolve(self, ref: ResourceRef) -> VersionInfo:
        """`'v1/pods'`, `'lorarl.dev/v1alpha1/lorarljobs'`, `('', 'v1', 'pods')`, or a plural,
        kind or short name (`'lrj'`) -> the served resource."""
        if isinstance(ref, tuple):
            res = kmock.resource(*ref)
        elif isinstance(ref, kmock.resource):
            res = ref
        else:
            res = kmock.resource(ref)
        if res.group is not None and res.version and res.plural:
            info = self._info(res.group, res.version, res.plural)
        else:
            wanted = str(ref).lower()
            candidates = [
                i
                for i in self.served()
                if wanted in (i.plural, i.singular, i.kind.lower(), *i.short_names)
            ]
            candidates.sort(
                key=lambda i: (
                    i.group != "",
                    i.group,
                    [-x for x in discovery.version_priority(i.version)],
                )
            )
            info = candidates[0] if candidates else None
        if info is None:
            raise ValueError(
                f"unknown resource {ref!r}: declare it with add_crd() or emulator.resources[...]"
            )
        return info

    def _info_for(self, group: str, plural: str) -> VersionInfo:
        for info in self.served():
            if (info.group, info.plural) == (group, plural):
                return info
        raise ValueError(f"resource {errors.qualified(group, plural)} is no longer served")

    # -- admission -----------------------------------------------------------------------------
    def add_admission_hook(
        self,
        hook: admission.AdmissionHook,
        *,
        name: str = "test.admission.hook",
        resource: ResourceRef | None = None,
        operations: Collection[str] = ("CREATE", "UPDATE"),
        subresources: Collection[str | None] = (None,),
    ) -> admission.AdmissionRule:
        """Call `hook` with an AdmissionReview before matching writes commit (a validating
        webhook); see `admission.http_hook` to forward reviews to a real webhook server."""
        info = self.resolve(resource) if resource is not None else None
        rule = admission.AdmissionRule(
            name=name,
            hook=hook,
            group=info.group if info else None,
            plural=info.plural if info else None,
            operations=frozenset(operations),
            subresources=frozenset(subresources),
        )
        self._admission_rules.append(rule)
        return rule

    def _admit(
        self, info: VersionInfo, ns: str | None, sub: str | None
    ) -> Callable[[str, Obj | None, Obj | None], None] | None:
        rules = list(self._admission_rules)
        if not rules:
            return None
        return lambda op, new, old: admission.run_hooks(rules, info, op, ns, new, old, sub)

    # -- plumbing ------------------------------------------------------------------------------
    @staticmethod
    def _gv(info: VersionInfo) -> str:
        return f"{info.group}/{info.version}" if info.group else info.version

    def _present(self, info: VersionInfo, obj: Obj) -> Obj:
        """The object as seen through the requested version (no conversion: one schema)."""
        return {**obj, "apiVersion": self._gv(info)}

    def _filter(
        self, request: kmock.Request, info: VersionInfo, name: str | None
    ) -> Callable[[Obj], bool]:
        field_selector = request.params.get("fieldSelector") or ""
        if name is not None:
            field_selector = ",".join(filter(None, [f"metadata.name={name}", field_selector]))
        return selectors.make_filter(
            request.params.get("labelSelector"),
            field_selector,
            info.group,
            info.plural,
            info.selectable_fields,
        )

    @staticmethod
    def _header(request: kmock.Request, name: str) -> str | None:
        raw = request._raw_request
        return raw.headers.get(name) if raw is not None else None

    def _body(self, request: kmock.Request, required: bool = True) -> Any:
        text = request.body.decode("utf-8", errors="replace")
        if not text.strip():
            if required:
                raise errors.bad_request(
                    f"{request.method.value} {request.url.path}: the request body is empty"
                )
            return None
        content_type = self._header(request, "Content-Type") or ""
        try:
            return yaml.safe_load(text) if "yaml" in content_type else json.loads(text)
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(
                f"the request body is not valid "
                f"{'YAML' if 'yaml' in content_type else 'JSON'}: {exc}"
            ) from exc

    def _on_commit(self, event: Event) -> None:
        """Mirror into kmock's `objects` view, so kmock-style assertions see every version;
        stop serving a CRD's resource once the CRD is gone."""
        group, plural, ns, name = event.key
        if (group, plural) == (CRD_GROUP, CRD_PLURAL) and event.type == "DELETED":
            for key in [
                k for k, v in self._crd_versions.items() if f"{v.plural}.{v.group}" == name
            ]:
                del self._crd_versions[key]
                del self.resources[kmock.resource(*key)]
        version = str(event.obj.get("apiVersion", "")).rsplit("/", 1)[-1]
        key = (_resource(group, version, plural), ns, name)
        if key not in self._objects:
            self._objects[key] = event.obj
            if event.type == "DELETED":
                self._objects[key].delete()
            return
        mirrored = self._objects[key]
        if event.type == "ADDED":
            mirrored.create(event.obj)
            return
        mirrored.history.append(event.obj)
        if event.type == "DELETED":
            mirrored.delete()
