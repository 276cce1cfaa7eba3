"""A pod's volumes as host directories, made the way the kubelet makes them.

- emptyDir: a fresh directory (mode 0777), a tmpfs for `medium: Memory` (mounted in the host's
  mount namespace under the kubelet's own state directory, so every container of the pod shares
  it, as they do in a pod);
- configMap / secret: their keys (or `items`) written as files, read from the API server;
- persistentVolumeClaim: the claim must exist in the API server (else the pod stays Pending, as
  an unbound claim keeps it unscheduled); its data is one directory per claim for the kubelet's
  whole life (`Kubelet.claim_dir`), so tests put models and data there and read outputs back;
- projected: ServiceAccount tokens from TokenRequest (bound to the pod, for its audience and
  expiry; not refreshed: a test is shorter than a token's life), configMap, secret and
  downwardAPI (metadata fields) sources in one directory: the `kube-api-access-*` volume the
  API server adds to every pod, and the chart's own projected volumes;
- fsGroup: volumes are group-owned by it and group-writable (setgid directories), as kubelet does.

Other volume kinds are refused by name: better a clear failure than a silent half-emulation.
"""

from __future__ import annotations

import base64
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .api import Api, NotFound

Obj = dict[str, Any]


class VolumeError(RuntimeError):
    """A volume cannot be set up; `reason` is what the pod's status shows."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Volume:
    name: str
    path: Path
    read_only: bool = False  # forced by the source (a read-only claim, configMap, secret)
    tmpfs: bool = False


def _write_items(folder: Path, data: dict[str, bytes], source: Obj, mode: int) -> None:
    items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise VolumeError("FailedMount", f"configmap/secret has no key {item['key']!r}")
        target = folder / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[item["key"]])
        os.chmod(target, item.get("mode", mode))


def secret_data(secret: Obj) -> dict[str, bytes]:
    """`data` (base64); `stringData` too, which a real API server folds into `data` on write."""
    out = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    out |= {k: v.encode() for k, v in (secret.get("stringData") or {}).items()}
    return out


def config_map_data(config_map: Obj) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in (config_map.get("data") or {}).items()}
    out |= {k: base64.b64decode(v) for k, v in (config_map.get("binaryData") or {}).items()}
    return out


def give_group(path: Path, gid: int, recursive: bool, read_only: bool = False) -> None:
    """fsGroup: group ownership, group rw (r for a Secret, ConfigMap or projected volume, whose
    files get 0440 added as kubelet does: a 0400 key stays readable by the pod's group),
    setgid directories (what kubelet does to volumes)."""
    paths = [path, *(path.rglob("*") if recursive else ())]
    for p in paths:
        if p.is_symlink():
            continue
        os.chown(p, -1, gid)
        mode = os.stat(p).st_mode & 0o7777
        if p.is_dir():
            os.chmod(p, mode | (0o2050 if read_only else 0o2070))
        elif read_only:
            os.chmod(p, mode | 0o440)
        else:
            os.chmod(p, mode | 0o060 | (0o010 if mode & 0o100 else 0))


def prepare(
    api: Api,
    pod: Obj,
    pod_dir: Path,
    claim_dir: Any,  # Callable[[str, str], Path]
    fs_group: int | None,
) -> dict[str, Volume]:
    """Every volume of `pod` on the host; raises VolumeError."""
    ns = pod["metadata"]["namespace"]
    out: dict[str, Volume] = {}
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        folder = pod_dir / "volumes" / name
        if "emptyDir" in vol:
            folder.mkdir(parents=True)
            os.chmod(folder, 0o777)
            source = vol["emptyDir"] or {}
            if source.get("medium") == "Memory":
                size = source.get("sizeLimit")
                opts = "mode=1777" + (f",size={_tmpfs_size(size)}" if size else "")
                subprocess.run(["mount", "-t", "tmpfs", "-o", opts, f"lrk-{name}", str(folder)],
                               check=True, capture_output=True)  # fmt: skip
                out[name] = Volume(name, folder, tmpfs=True)
            else:
                out[name] = Volume(name, folder)
        elif "configMap" in vol or "secret" in vol:
            is_secret = "secret" in vol
            source = vol["secret"] if is_secret else vol["configMap"]
            ref = source["secretName"] if is_secret else source["name"]
            kind = "Secret" if is_secret else "ConfigMap"
            try:
                obj = api.object(ns, kind, ref)
                data = secret_data(obj) if is_secret else config_map_data(obj)
            except NotFound:
                if not source.get("optional"):
                    raise VolumeError(
                        "FailedMount", f'{kind.lower()} "{ref}" not found (volume {name})'
                    ) from None
                data = {}
            folder.mkdir(parents=True)
            _write_items(folder, data, source, source.get("defaultMode", 0o644))
            out[name] = Volume(name, folder, read_only=True)
        elif "projected" in vol:
            source = vol["projected"] or {}
            folder.mkdir(parents=True)
            _project(api, pod, folder, source)
            out[name] = Volume(name, folder, read_only=True)
        elif "persistentVolumeClaim" in vol:
            source = vol["persistentVolumeClaim"]
            claim = source["claimName"]
            try:
                api.object(ns, "PersistentVolumeClaim", claim)
            except NotFound:
                raise VolumeError(
                    "Unschedulable", f'persistentvolumeclaim "{claim}" not found'
                ) from None
            path = claim_dir(ns, claim)
            out[name] = Volume(name, path, read_only=bool(source.get("readOnly")))
        else:
            kinds = sorted(set(vol) - {"name"})
            raise VolumeError(
                "CreateContainerConfigError",
                f"volume {name}: {kinds} volumes are not supported by the process kubelet",
            )
        if fs_group is None:
            continue
        if not out[name].read_only:
            give_group(out[name].path, fs_group, recursive="persistentVolumeClaim" in vol)
        elif any(k in vol for k in ("secret", "configMap", "projected")):
            give_group(out[name].path, fs_group, recursive=True, read_only=True)
    return out


def _project(api: Api, pod: Obj, folder: Path, volume: Obj) -> None:
    meta = pod["metadata"]
    ns = meta["namespace"]
    mode = volume.get("defaultMode", 0o644)
    for source in volume.get("sources") or []:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            account = pod["spec"].get("serviceAccountName") or "default"
            request: Obj = {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenRequest",
                "spec": {
                    "expirationSeconds": token.get("expirationSeconds", 3600),
                    "boundObjectRef": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": meta["name"],
                        "uid": meta["uid"],
                    },
                },
            }
            if token.get("audience"):
                request["spec"]["audiences"] = [token["audience"]]
            path = f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token"
            try:
                issued = (api.create(path, request) or {})["status"]["token"]
            except Exception as exc:
                raise VolumeError("FailedMount", f"token for {account}: {exc}") from None
            items = {"items": [{"key": "token", "path": token["path"]}]}
            _write_items(folder, {"token": issued.encode()}, items, mode)
        elif "configMap" in source or "secret" in source:
            is_secret = "secret" in source
            ref = source["secret"] if is_secret else source["configMap"]
            kind = "Secret" if is_secret else "ConfigMap"
            try:
                obj = api.object(ns, kind, ref["name"])
            except NotFound:
                if ref.get("optional"):
                    continue
                raise VolumeError(
                    "FailedMount", f'{kind.lower()} "{ref["name"]}" not found'
                ) from None
            data = secret_data(obj) if is_secret else config_map_data(obj)
            _write_items(folder, data, ref, mode)
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                field = (item.get("fieldRef") or {}).get("fieldPath", "")
                value = _metadata_field(meta, field)
                _write_items(folder, {"v": value.encode()}, {"items": [
                    {"key": "v", "path": item["path"]}]}, item.get("mode", mode))  # fmt: skip
        else:
            raise VolumeError("FailedMount", f"projected source {sorted(source)} is not supported")


def _metadata_field(meta: Obj, field: str) -> str:
    if field in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return str(meta.get(field.split(".", 1)[1], ""))
    if field in ("metadata.labels", "metadata.annotations"):
        values = meta.get(field.split(".", 1)[1]) or {}
        return "".join(f'{k}="{v}"\n' for k, v in sorted(values.items()))
    raise VolumeError("FailedMount", f"downwardAPI field {field!r} is not supported")


def _tmpfs_size(quantity: str) -> str:
    """A Kubernetes quantity as tmpfs `size=` (bytes)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}  # fmt: skip
    text = str(quantity)
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return str(int(float(text[: -len(suffix)]) * factor))
    return str(int(float(text)))
