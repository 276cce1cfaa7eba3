"""One container's launch: its environment, command and identity, resolved as kubelet does.

- env: `envFrom`, then `env` in order; each value's `$(VAR)` expands against what was defined
  before it (lorarl.local.env_refs, the kubelet's rules); `secretKeyRef` / `configMapKeyRef` /
  `fieldRef` are read from the API server and the pod; a missing Secret or key (not optional)
  is `CreateContainerConfigError` with kubelet's message. The image's ENV sits underneath.
- argv: `command` + `args` expanded against the container's env (the image's CMD if both are
  empty), with the image's interpreter mapped to the local one (images.Image.program).
- identity: runAsUser/runAsGroup (container over pod over the image's USER), fsGroup and
  supplementalGroups as groups, allowPrivilegeEscalation=false as no_new_privs, a dropped ALL
  capability set, readOnlyRootFilesystem; runAsNonRoot refuses a root user, as kubelet does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorarl.local.env_refs import expand

from .api import Api, NotFound
from .images import ROOT, Image
from .volumes import config_map_data, secret_data

Obj = dict[str, Any]
_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


class ConfigError(RuntimeError):
    """CreateContainerConfigError: the container cannot be configured (kubelet's words)."""

    reason = "CreateContainerConfigError"


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    workdir: str
    uid: int | None
    gid: int | None
    groups: list[int] = field(default_factory=list)
    no_new_privs: bool = False
    drop_caps: bool = False
    read_only_root: bool = False
    reachable: list[str] = field(default_factory=list)  # host paths the user must be able to exec
    host_paths: list[str] = field(default_factory=list)  # host dirs the container must see as is
    passwd: list[str] = field(default_factory=list)  # the image's own accounts (images.accounts)
    group: list[str] = field(default_factory=list)


# Host folders every container sees at their own paths: the checkout holding the venvs that stand
# in for images (podinit binds it where the root view would leave it out, e.g. under /tmp).
HOST_PATHS: list[Path] = [ROOT]


def _key_ref(api: Api, ns: str, kind: str, ref: Obj) -> str | None:
    try:
        obj = api.object(ns, kind, ref["name"])
    except NotFound:
        if ref.get("optional"):
            return None
        raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found') from None
    data = secret_data(obj) if kind == "Secret" else config_map_data(obj)
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise ConfigError(f"couldn't find key {ref['key']} in {kind} {ns}/{ref['name']}")
    return data[ref["key"]].decode()


def _field_ref(pod: Obj, path: str) -> str:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return simple[path] or ""
    m = _FIELD_LABEL.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ConfigError(f"fieldRef {path!r} is not supported")


def service_env(namespace: str, services: list[Obj], enable_links: bool) -> dict[str, str]:
    """What kubelet puts first in every container's env: the API server's Service (always) and,
    with `enableServiceLinks` (the default), `<NAME>_SERVICE_HOST/PORT` of each Service in the
    pod's namespace."""
    out: dict[str, str] = {}
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        ip, ports = spec.get("clusterIP"), spec.get("ports") or []
        api = (meta["namespace"], meta["name"]) == ("default", "kubernetes")
        if not ip or ip == "None" or not ports:
            continue
        if not api and not (enable_links and meta["namespace"] == namespace):
            continue
        name = meta["name"].upper().replace("-", "_")
        out[f"{name}_SERVICE_HOST"] = ip
        out[f"{name}_SERVICE_PORT"] = str(ports[0]["port"])
        for port in ports:
            if port.get("name"):
                key = port["name"].upper().replace("-", "_")
                out[f"{name}_SERVICE_PORT_{key}"] = str(port["port"])
    return out


def environment(
    api: Api, pod: Obj, container: Obj, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The env kubelet hands the runtime (without the image's ENV), on top of `base`."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = dict(base or {})
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in source:
                continue
            ref = source[key]
            try:
                obj = api.object(ns, kind, ref["name"])
            except NotFound:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind.lower()} "{ref["name"]}" not found') from None
            data = secret_data(obj) if kind == "Secret" else config_map_data(obj)
            env |= {prefix + k: v.decode() for k, v in data.items()}
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            value = _key_ref(api, ns, "Secret", source["secretKeyRef"])
        elif "configMapKeyRef" in source:
            value = _key_ref(api, ns, "ConfigMap", source["configMapKeyRef"])
        elif "fieldRef" in source:
            value = _field_ref(pod, source["fieldRef"]["fieldPath"])
        else:
            raise ConfigError(f"env {name}: {sorted(source)} is not supported")
        if value is not None:
            env[name] = value
    return env


def _image_cmd(image: Image) -> list[str]:
    from harness.kubelet.dockerfile import stages

    final = stages(image.dockerfile.read_text())[-1].instructions
    entrypoint = [json.loads(a) for k, a in final if k == "ENTRYPOINT"]
    cmd = [json.loads(a) for k, a in final if k == "CMD"]
    return [*(entrypoint[-1] if entrypoint else []), *(cmd[-1] if cmd else [])]


def _user(image: Image) -> tuple[int | None, int | None]:
    if not image.user:
        return None, None
    uid, _, gid = image.user.partition(":")
    return int(uid), int(gid) if gid else None


def launch(
    api: Api, pod: Obj, container: Obj, image: Image, services: Mapping[str, str] | None = None
) -> Launch:
    spec = pod["spec"]
    psc: Mapping[str, Any] = spec.get("securityContext") or {}
    csc: Mapping[str, Any] = container.get("securityContext") or {}
    env = environment(api, pod, container, services)
    argv = [expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
    argv = argv or _image_cmd(image)
    if argv:
        argv[0] = image.program(argv[0])
    image_uid, image_gid = _user(image)
    uid = csc.get("runAsUser", psc.get("runAsUser", image_uid))
    gid = csc.get("runAsGroup", psc.get("runAsGroup", image_gid))
    if csc.get("runAsNonRoot", psc.get("runAsNonRoot")) and not uid:
        raise ConfigError("container has runAsNonRoot and image will run as root")
    groups = [g for g in [psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])] if g]
    drop = [c.upper() for c in (csc.get("capabilities") or {}).get("drop") or []]
    hostname = spec.get("hostname") or pod["metadata"]["name"]
    full_env = {**image.env, "HOSTNAME": hostname, **env}
    return Launch(
        argv=argv,
        env=full_env,
        workdir=container.get("workingDir") or image.workdir,
        uid=uid,
        gid=gid if gid is not None else (0 if uid else None),  # unset: root group, as runtimes do
        groups=sorted(set(groups)),
        no_new_privs=csc.get("allowPrivilegeEscalation") is False,
        drop_caps="ALL" in drop,
        read_only_root=bool(csc.get("readOnlyRootFilesystem")),
        reachable=[os.path.realpath(image.python)],
        host_paths=[str(p) for p in HOST_PATHS],
        passwd=list(image.passwd),
        group=list(image.group),
    )
