"""Test support: a Kubernetes API server emulator for operator tests (see tests/support/kube/).

Usage::

    from tests.support.kube_emulator import kube_api

    with kube_api(crds=[crd_manifest]) as kube:
        kube.kubectl('get', 'lrj')            # real kubectl
        kube.api_client()                     # official `kubernetes` client
        kube.emulator.set_pod_phase('default', 'trainer-0', 'Failed', exit_code=137)
        kube.collect_garbage()
"""

from tests.support.kube import (
    AdmissionHook,
    AdmissionRule,
    ApiError,
    KubeApi,
    KubeEmulator,
    http_hook,
    kube_api,
    kubectl_binary,
    parse_crd,
    write_kubeconfig,
)

__all__ = [
    "AdmissionHook",
    "AdmissionRule",
    "ApiError",
    "KubeApi",
    "KubeEmulator",
    "http_hook",
    "kube_api",
    "kubectl_binary",
    "parse_crd",
    "write_kubeconfig",
]
