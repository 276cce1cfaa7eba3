"""Cluster DNS as hosts files: one per pod (bind-mounted at its /etc/hosts) and one for processes
on the host that need the cluster's names (bind-mounted the same way in their mount namespace).

A Service with a ClusterIP has the record `<name>.<ns>.svc.cluster.local` -> its ClusterIP
(reached through proxy.py's rules), with the same search-path forms. A pod's record
`<hostname>.<subdomain>.<ns>.svc.cluster.local` exists only once a headless Service named
`<subdomain>` in its namespace selects it, as CoreDNS publishes it. The names a resolver reaches
through the pod's search path are listed too: `h.s.ns.svc`, `h.s.ns` from any namespace, `h.s`
only from the pod's own. Files only ever grow (appended in place, so a bind mount sees the
change, and a pod's address is stable across its re-creations): a reader never sees a
half-written replacement.
"""

from __future__ import annotations

import threading
from pathlib import Path

from .policy import matches

HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
DOMAIN = "svc.cluster.local"


def record(hostname: str, subdomain: str, namespace: str, ip: str, *, same_ns: bool) -> str:
    fqdn = f"{hostname}.{subdomain}.{namespace}.{DOMAIN}"
    names = [fqdn, f"{hostname}.{subdomain}.{namespace}.svc", f"{hostname}.{subdomain}.{namespace}"]
    if same_ns:
        names.append(f"{hostname}.{subdomain}")
    return f"{ip}\t{' '.join(names)}\n"


def service_record(name: str, namespace: str, ip: str, *, same_ns: bool) -> str:
    names = [f"{name}.{namespace}.{DOMAIN}", f"{name}.{namespace}.svc", f"{name}.{namespace}"]
    if same_ns:
        names.append(name)
    return f"{ip}\t{' '.join(names)}\n"


def own_line(pod: dict, ip: str) -> str:
    """kubelet's own entry for the pod: its FQDN (with a subdomain) and its bare hostname."""
    spec, meta = pod["spec"], pod["metadata"]
    hostname = spec.get("hostname") or meta["name"]
    if spec.get("subdomain"):
        fqdn = f"{hostname}.{spec['subdomain']}.{meta['namespace']}.{DOMAIN}"
        return f"{ip}\t{fqdn}\t{hostname}\n"
    return f"{ip}\t{hostname}\n"


class ClusterDns:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.host_file = folder / "hosts"
        self.host_file.write_text(HEADER)
        self._records: dict[str, tuple[str, str, str, str]] = {}  # key -> (ns, host, sub, ip)
        self._published: set[str] = set()
        self._pods: dict[str, tuple[str, Path]] = {}  # uid -> (namespace, hosts file)
        self._lock = threading.Lock()

    def pod_file(self, uid: str, pod: dict, ip: str, path: Path) -> Path:
        """The pod's hosts file: its own entry and every record published so far."""
        ns = pod["metadata"]["namespace"]
        with self._lock:
            lines = [HEADER, own_line(pod, ip)]
            for key in sorted(self._published):
                rec_ns, hostname, subdomain, rec_ip = self._records[key]
                if not subdomain:
                    lines.append(service_record(hostname, rec_ns, rec_ip, same_ns=rec_ns == ns))
                    continue
                lines.append(record(hostname, subdomain, rec_ns, rec_ip, same_ns=rec_ns == ns))
            path.write_text("".join(lines))
            self._pods[uid] = (ns, path)
        return path

    def forget(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)

    def publish(self, pods: list[dict], services: list[dict], ips: dict[str, str]) -> None:
        """Add records for pods that now have an address and a headless Service selecting them."""
        headless = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): s
            for s in services
            if (s.get("spec") or {}).get("clusterIP") == "None"
        }
        new: list[tuple[str, str, str, str, str]] = []  # key, ns, hostname, subdomain, ip
        for svc in services:
            meta, ip = svc["metadata"], (svc.get("spec") or {}).get("clusterIP")
            if ip and ip != "None":
                new.append((f"svc:{meta['namespace']}/{meta['name']}", meta["namespace"],
                            meta["name"], "", ip))  # fmt: skip
        with self._lock:
            for key, ns, name, _, ip in new:
                if key in self._published:
                    continue
                self._records[key] = (ns, name, "", ip)
                self._published.add(key)
                self._append(self.host_file, service_record(name, ns, ip, same_ns=False))
                for pod_ns, path in list(self._pods.values()):
                    self._append(path, service_record(name, ns, ip, same_ns=pod_ns == ns))
            for pod in pods:
                meta, spec = pod["metadata"], pod["spec"]
                ns, sub = meta["namespace"], spec.get("subdomain")
                hostname = spec.get("hostname") or meta["name"]
                key = f"{ns}/{hostname}.{sub}"
                ip = ips.get(meta.get("uid", ""))
                service = headless.get((ns, sub)) if sub else None
                if key in self._published or ip is None or service is None:
                    continue
                selector = service["spec"].get("selector")
                if not selector or not matches({"matchLabels": selector}, meta.get("labels") or {}):
                    continue
                self._records[key] = (ns, hostname, sub, ip)
                self._published.add(key)
                self._append(self.host_file, record(hostname, sub, ns, ip, same_ns=False))
                for pod_ns, path in list(self._pods.values()):
                    self._append(path, record(hostname, sub, ns, ip, same_ns=pod_ns == ns))

    @staticmethod
    def _append(path: Path, line: str) -> None:
        with open(path, "a") as f:
            f.write(line)
