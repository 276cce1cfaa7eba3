"""What tests do to the cluster directly: seed and inspect objects, and play the kubelet and the
garbage collector (which the emulator does not run). Thread-safe; these writes skip admission, as a
controller's would not need it in a test."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import actors, errors, patches, selectors
from .store import Obj, now_rfc3339

if TYPE_CHECKING:
    from .emulator import KubeEmulator, ResourceRef


class TestHelpers:
    """Mixed into KubeEmulator (slot-free, so the attrs class keeps its slots)."""

    __slots__ = ()
    __test__ = False  # not a pytest test class

    def create(
        self: KubeEmulator, ref: ResourceRef, body: Mapping[str, Any], namespace: str | None = None
    ) -> Obj:
        info = self.resolve(ref)
        ns = (
            namespace
            or (body.get("metadata") or {}).get("namespace")
            or ("default" if info.namespaced else None)
        )
        return self._present(info, self._after_write(info, self.store.create(info, ns, body)))

    def get(self: KubeEmulator, ref: ResourceRef, namespace: str | None, name: str) -> Obj | None:
        info = self.resolve(ref)
        obj = self.store.find(info, namespace, name)
        return self._present(info, obj) if obj is not None else None

    def list_objects(
        self: KubeEmulator,
        ref: ResourceRef,
        namespace: str | None = None,
        label_selector: str | None = None,
    ) -> list[Obj]:
        info = self.resolve(ref)
        match = selectors.make_filter(label_selector, None, info.group, info.plural)
        return [self._present(info, o) for o in self.store.list(info, namespace, match)[0]]

    def patch(
        self: KubeEmulator,
        ref: ResourceRef,
        namespace: str | None,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> Obj:
        """A JSON merge patch, as a controller would send it."""
        info = self.resolve(ref)
        obj = self.store.update(
            info,
            namespace,
            name,
            lambda old: patches.merge_patch(old, patch),
            subresource=subresource,
        )
        return self._present(info, obj)

    def delete(self: KubeEmulator, ref: ResourceRef, namespace: str | None, name: str) -> Obj:
        info = self.resolve(ref)
        return self._present(info, self.store.delete(info, namespace, name))

    def events(self: KubeEmulator, namespace: str | None = None) -> list[Obj]:
        """Core v1 Events (what operators post for every transition)."""
        return self.list_objects("v1/events", namespace)

    def set_pod_phase(
        self: KubeEmulator,
        namespace: str,
        name: str,
        phase: str,
        exit_code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> Obj:
        """Play the kubelet: move every container of the pod to `phase` (through /status)."""
        info = self.resolve("v1/pods")
        now = now_rfc3339()
        obj = self.store.update(
            info,
            namespace,
            name,
            lambda pod: {
                **pod,
                "status": actors.pod_status(pod, phase, now, exit_code, reason, message),
            },
            subresource="status",
        )
        return self._present(info, obj)

    def collect_garbage(self: KubeEmulator) -> list[tuple[str, str | None, str]]:
        """Play the garbage collector until nothing changes: delete objects whose owners are all
        gone (finalizers still gate them), drop references to owners that are gone.
        Returns (kind, namespace, name) of every object it deleted or marked for deletion."""
        removed: list[tuple[str, str | None, str]] = []
        while True:
            to_delete, to_trim = actors.orphans(self.store.all_objects())
            if not to_delete and not to_trim:
                return removed
            for (group, plural, ns, name), refs in to_trim.items():
                with contextlib.suppress(errors.ApiError):
                    self.store.update(
                        self._info_for(group, plural),
                        ns,
                        name,
                        lambda old, r=refs: {
                            **old,
                            "metadata": {**old["metadata"], "ownerReferences": r},
                        },
                    )
            for group, plural, ns, name in to_delete:
                info = self._info_for(group, plural)
                with contextlib.suppress(errors.ApiError):
                    self.store.delete(info, ns, name)
                    removed.append((info.kind, ns, name))
