"""A Kubernetes API server emulator (on kmock) for kopf, the `kubernetes` client and kubectl."""

from .admission import AdmissionHook, AdmissionRule, http_hook
from .crds import PrinterColumn, ScalePaths, VersionInfo, parse_crd
from .emulator import KubeEmulator
from .errors import ApiError
from .harness import KubeApi, kube_api, kubectl_binary, write_kubeconfig

__all__ = [
    "AdmissionHook",
    "AdmissionRule",
    "ApiError",
    "KubeApi",
    "KubeEmulator",
    "PrinterColumn",
    "ScalePaths",
    "VersionInfo",
    "http_hook",
    "kube_api",
    "kubectl_binary",
    "parse_crd",
    "write_kubeconfig",
]
