"""Where job data comes from: a local run (`LocalStore`) or the Kubernetes API (`KubeStore`)."""

from lorarl.server.stores.base import JobNotFound, JobStore, StoreUnavailable
from lorarl.server.stores.kube import KubeStore
from lorarl.server.stores.local import LOCAL_NAMESPACE, LocalStore

__all__ = [
    "LOCAL_NAMESPACE",
    "JobNotFound",
    "JobStore",
    "KubeStore",
    "LocalStore",
    "StoreUnavailable",
]
