"""REST status API and dashboard (FastAPI), backed by a local run or by the Kubernetes API."""

from lorarl.server.app import create_app
from lorarl.server.auth import KubeAuth
from lorarl.server.kube_api import KubeApi
from lorarl.server.stores import JobStore, KubeStore, LocalStore

__all__ = ["JobStore", "KubeApi", "KubeAuth", "KubeStore", "LocalStore", "create_app"]
