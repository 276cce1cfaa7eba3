"""NetworkPolicy (networking.k8s.io/v1) semantics -> an nftables ruleset per pod (pure).

A pod selected by no policy of a direction accepts everything in that direction; a selected pod
accepts only what some rule of some selecting policy allows (policies are additive). Loopback
(which includes a pod reaching its own IP) and replies to allowed connections always pass, as
they do with real CNIs. Peers are every endpoint the kubelet knows: its pods and the host's end
of the bridge (the node), whose traffic always passes (Kubernetes' rule: kubelet probes, and the
API server's calls, which reach pods through the node).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]
TABLE = "lorarl_kubelet_policy"
NAME_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Endpoint:
    """Something with an address that policies can name: a pod, or the operator's stand-in."""

    namespace: str
    labels: Mapping[str, str]
    ip: str
    ports: Mapping[str, tuple[str, int]] = field(default_factory=dict)  # name -> (proto, port)


def matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A metav1.LabelSelector; an empty selector matches everything."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"label selector operator {op!r} is not valid")
    return True


def _types(policy: Obj) -> list[str]:
    spec = policy.get("spec") or {}
    if spec.get("policyTypes"):
        return list(spec["policyTypes"])
    return ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def selects(policy: Obj, pod: Endpoint) -> bool:
    meta, spec = policy["metadata"], policy.get("spec") or {}
    return meta.get("namespace") == pod.namespace and matches(spec.get("podSelector"), pod.labels)


def _peer_ips(
    peer: Obj, policy_ns: str, endpoints: Sequence[Endpoint], ns_labels: Mapping[str, Mapping]
) -> list[str]:
    if "ipBlock" in peer:
        block = ipaddress.ip_network(peer["ipBlock"]["cidr"])
        excepted = [ipaddress.ip_network(c) for c in peer["ipBlock"].get("except") or []]
        return [
            e.ip
            for e in endpoints
            if ipaddress.ip_address(e.ip) in block
            and not any(ipaddress.ip_address(e.ip) in x for x in excepted)
        ]
    out = []
    for e in endpoints:
        if not e.namespace:  # the node: pod and namespace selectors never pick it
            continue
        if "namespaceSelector" in peer:
            labels = {**ns_labels.get(e.namespace, {}), NAME_LABEL: e.namespace}
            if not matches(peer["namespaceSelector"], labels):
                continue
        elif e.namespace != policy_ns:
            continue
        if "podSelector" in peer and not matches(peer["podSelector"], e.labels):
            continue
        out.append(e.ip)
    return out


def _port_matches(rule_ports: list[Obj] | None, target: Endpoint) -> list[str] | None:
    """nft match fragments for a rule's ports (None: all ports); named ports resolve against the
    target pod's container ports, and a name it does not have matches nothing."""
    if not rule_ports:
        return None
    out = []
    for p in rule_ports:
        proto = (p.get("protocol") or "TCP").lower()
        port = p.get("port")
        if port is None:
            out.append(f"meta l4proto {proto}")
        elif isinstance(port, str):
            named = target.ports.get(port)
            if named and named[0].lower() == proto:
                out.append(f"{proto} dport {named[1]}")
        elif p.get("endPort"):
            out.append(f"{proto} dport {port}-{p['endPort']}")
        else:
            out.append(f"{proto} dport {port}")
    return out


def _chain_rules(
    pod: Endpoint,
    policies: Sequence[Obj],
    endpoints: Sequence[Endpoint],
    ns_labels: Mapping[str, Mapping],
    direction: str,
) -> list[str] | None:
    """The accept rules of one direction, or None when no policy of that direction selects pod."""
    chosen = [p for p in policies if direction in _types(p) and selects(p, pod)]
    if not chosen:
        return None
    key, addr = ("ingress", "saddr") if direction == "Ingress" else ("egress", "daddr")
    peers_key = "from" if direction == "Ingress" else "to"
    rules: list[str] = []
    for policy in chosen:
        for rule in (policy.get("spec") or {}).get(key) or []:
            # Egress ports are the destination's ports, which are numbers on the peer.
            ports = _port_matches(rule.get("ports"), pod if direction == "Ingress" else Endpoint(
                pod.namespace, {}, pod.ip))  # fmt: skip
            if rule.get(peers_key) is None:
                sources: list[str] | None = None
            else:
                ns = policy["metadata"]["namespace"]
                sources = sorted(
                    {
                        ip
                        for peer in rule[peers_key]
                        for ip in _peer_ips(peer, ns, endpoints, ns_labels)
                    }
                )
                if not sources:
                    continue
            who = "" if sources is None else f"ip {addr} {{ {', '.join(sources)} }} "
            if ports is None:
                rules.append(f"{who}accept")
            else:
                rules += [f"{who}{port} accept" for port in ports]
    return rules


def ruleset(
    pod: Endpoint,
    policies: Sequence[Obj],
    endpoints: Sequence[Endpoint],
    ns_labels: Mapping[str, Mapping] | None = None,
    node_ip: str | None = None,
) -> str:
    """The complete nft script for `pod`'s network namespace (replaces the table atomically).
    Traffic to and from `node_ip` (the node the pod runs on) always passes, as Kubernetes
    defines it: kubelet probes, and the API server's calls that reach pods through the node."""
    ns_labels = ns_labels or {}
    lines = [f"table inet {TABLE}", f"delete table inet {TABLE}", f"table inet {TABLE} {{"]
    for direction, hook in (("Ingress", "input"), ("Egress", "output")):
        rules = _chain_rules(pod, policies, endpoints, ns_labels, direction)
        if rules is None:
            continue
        iface = "iif" if hook == "input" else "oif"
        lines += [
            f"  chain {direction.lower()} {{",
            f"    type filter hook {hook} priority 0; policy drop;",
            f'    {iface} "lo" accept',
            "    ct state established,related accept",
            *(
                [f"    ip {'saddr' if hook == 'input' else 'daddr'} {node_ip} accept"]
                if node_ip
                else []
            ),
            *(f"    {r}" for r in rules),
            "    counter drop",  # what the policy refused, countable (`Kubelet.dropped`)
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"
