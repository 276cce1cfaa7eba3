"""Service traffic: ClusterIP -> a ready endpoint, in nftables, as kube-proxy's nftables mode does.

Why not kube-proxy itself: the test cluster's service CIDR is on loopback (127.100.0.0/16) so
that nothing a test sends can leave the machine, and kube-proxy does not handle a loopback
service range. The rules are the same idea in small: a DNAT per service port, from the
EndpointSlices the controller-manager writes (ready endpoints only; several are chosen among at
random per connection), in every pod's network namespace and on the host (where the API server
calls webhooks). A DNAT'd connection leaves with a loopback source, so the source is masqueraded
to the interface's address and `route_localnet` lets the kernel route it.

`default/kubernetes` has no endpoints here (the API server listens on the host's loopback):
pods reach it at its ClusterIP through a DNAT to the bridge address, which the host maps to the
API server's loopback port.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]
TABLE = "lorarl_kubelet_svc"


@dataclass(frozen=True)
class Route:
    cluster_ip: str
    protocol: str  # "tcp" | "udp"
    port: int
    targets: tuple[tuple[str, int], ...]  # (ip, port), sorted


def routes(
    services: Sequence[Obj], slices: Sequence[Obj], api: tuple[str, int] | None
) -> list[Route]:
    """Each ClusterIP service port with its ready endpoints (pure); `default/kubernetes` goes to
    `api` (left out when None: the host reaches the API server directly)."""
    by_service: dict[tuple[str, str], list[Obj]] = {}
    for s in slices:
        meta = s["metadata"]
        owner = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if owner:
            by_service.setdefault((meta["namespace"], owner), []).append(s)
    out = []
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or spec.get("type") == "ExternalName":
            continue
        kubernetes = (meta["namespace"], meta["name"]) == ("default", "kubernetes")
        for port in spec.get("ports") or []:
            proto = port.get("protocol", "TCP").lower()
            if kubernetes:
                targets = {api} if api else set()
            else:
                targets = {
                    (address, p["port"])
                    for s in by_service.get((meta["namespace"], meta["name"]), [])
                    for p in s.get("ports") or []
                    if p.get("name", "") == port.get("name", "")
                    and p.get("protocol", "TCP").lower() == proto
                    for e in s.get("endpoints") or []
                    if (e.get("conditions") or {}).get("ready", True)
                    for address in e.get("addresses") or []
                }
            if targets:
                out.append(Route(ip, proto, int(port["port"]), tuple(sorted(targets))))
    return sorted(out, key=lambda r: (r.cluster_ip, r.protocol, r.port))


def _dnat(route: Route) -> str:
    match = f"ip daddr {route.cluster_ip} {route.protocol} dport {route.port}"
    if len(route.targets) == 1:
        ((ip, port),) = route.targets
        return f"{match} dnat ip to {ip}:{port}"
    choices = ", ".join(f"{i} : {ip} . {port}" for i, (ip, port) in enumerate(route.targets))
    return f"{match} dnat ip to numgen random mod {len(route.targets)} map {{ {choices} }}"


def ruleset(
    table: str, out_iface: str, found: Sequence[Route], prerouting: Sequence[str] = ()
) -> str:
    """The nft script for one network namespace (replaces `table` atomically)."""
    lines = [f"table ip {table}", f"delete table ip {table}", f"table ip {table} {{"]
    if prerouting:
        lines += ["  chain prerouting {", "    type nat hook prerouting priority -100;",
                  *(f"    {r}" for r in prerouting), "  }"]  # fmt: skip
    lines += [
        "  chain output {",
        "    type nat hook output priority -100;",
        *(f"    {_dnat(r)}" for r in found),
        "  }",
        "  chain postrouting {",
        "    type nat hook postrouting priority 100;",
        f'    oifname "{out_iface}" ip saddr 127.0.0.0/8 masquerade',
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def api_prerouting(bridge: str, host_ip: str, api_port: int) -> str:
    """On the host: pods' packets to the bridge address at the API server's port -> loopback."""
    match = f'iifname "{bridge}" ip daddr {host_ip} tcp dport {api_port}'
    return f"{match} dnat ip to 127.0.0.1:{api_port}"
