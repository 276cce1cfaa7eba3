"""A process kubelet for tests: runs the Pods in the API server emulator as local processes, each
pod in its own network namespace on a test bridge, each container in its own mount/PID namespace
with a read-only root, its volumes, the cluster's DNS names and the pod's NetworkPolicy enforced
by nftables. See docs/architecture.md (the kubelet harness) and kubelet.py."""

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
