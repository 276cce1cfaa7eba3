"""Garbage collection by ownerReferences, over HTTP (the controller-manager's GC, in small).

Dependents of the kinds an operator creates are checked against their owners: an object none
of whose owners exists any more (by uid: a re-created owner of the same name does not count)
is deleted, in the background, as the default propagation does.
"""

from __future__ import annotations

from .api import Api, NotFound

DEPENDENT_KINDS = (
    "/api/v1/pods",
    "/api/v1/services",
    "/api/v1/configmaps",
    "/api/v1/secrets",
    "/api/v1/persistentvolumeclaims",
    "/apis/networking.k8s.io/v1/networkpolicies",
)


def _owner_alive(api: Api, namespace: str, ref: dict) -> bool:
    try:
        namespaced = api.namespaced(ref["apiVersion"], ref["kind"])
        path = api.path(ref["apiVersion"], ref["kind"], namespace if namespaced else None,
                        ref["name"])  # fmt: skip
        return api.get(path)["metadata"].get("uid") == ref.get("uid")
    except NotFound:
        return False


def collect_garbage(api: Api) -> list[str]:
    """Delete orphans; returns `kind/namespace/name` of each deleted object."""
    deleted = []
    alive: dict[str, bool] = {}
    for collection in DEPENDENT_KINDS:
        for obj in api.items(collection):
            meta = obj["metadata"]
            refs = meta.get("ownerReferences") or []
            if not refs or meta.get("deletionTimestamp"):
                continue
            ns = meta.get("namespace", "")
            for ref in refs:
                key = f"{ns}/{ref.get('uid')}"
                if key not in alive:
                    alive[key] = _owner_alive(api, ns, ref)
            if not any(alive[f"{ns}/{ref.get('uid')}"] for ref in refs):
                api.delete(f"{collection.rsplit('/', 1)[0]}/namespaces/{ns}/"
                           f"{collection.rsplit('/', 1)[1]}/{meta['name']}")  # fmt: skip
                deleted.append(f"{collection.rsplit('/', 1)[1]}/{ns}/{meta['name']}")
    return deleted
