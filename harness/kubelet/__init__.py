"""A process kubelet for tests: a Node of the real test cluster that runs the Pods the scheduler
binds to it as local processes, each pod in its own network namespace on a test bridge, each
container in its own mount/PID namespace with a read-only root, its volumes (projected
ServiceAccount tokens included), the cluster's DNS names, Services as nftables DNAT and the
pod's NetworkPolicy as nftables rules. See docs/architecture.md (the kubelet harness) and
kubelet.py."""

from .images import ImagePullError, buildable
from .kubelet import Kubelet
from .network import NamespacesUnavailable, leftovers, sweep_stale

__all__ = [
    "ImagePullError",
    "Kubelet",
    "NamespacesUnavailable",
    "buildable",
    "leftovers",
    "sweep_stale",
]
