"""`lorarl run JOB` without --local: create (or update) the LoRARLJob in the current cluster;
and the day-to-day commands on it (`lorarl list/status/logs/stop/resume/delete`), through the
Kubernetes API as kubectl would (the user's kubeconfig and RBAC).

The `kubernetes` client comes with the operator extra only, so a base install gets a one-line
ClusterError naming the extra; so do a missing kubeconfig, an unreachable API server and a cluster
that refuses the object (e.g. no CRD installed).
"""

from __future__ import annotations

import builtins

from lorarl.api.resource import GROUP, PLURAL, VERSION, LoRARLJob
from lorarl.errors import UserError

OPERATOR_EXTRA_HINT = "pip install 'lorarl[operator]'"
CHART_HINT = "helm install lorarl charts/lorarl -n lorarl-system --create-namespace"


class ClusterError(UserError):
    pass


def _client():
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ClusterError(
            f"applying a job to a cluster needs the kubernetes client ({exc.name} is not "
            f"installed): {OPERATOR_EXTRA_HINT}; or run it here with --local"
        ) from exc
    return client, config


def apply_job(job: LoRARLJob, namespace: str | None = None, kubeconfig: str | None = None) -> str:
    """Create the job, or replace its spec if it exists; returns 'created' or 'configured'."""
    client, config = _client()
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        config.load_kube_config(config_file=kubeconfig)
        if namespace is None:
            namespace = job.metadata.namespace
        if namespace is None:
            _, context = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = context.get("context", {}).get("namespace", "default")
    except (ConfigException, OSError) as exc:
        raise ClusterError(
            f"no cluster configured ({exc}); point KUBECONFIG or --kubeconfig at one, "
            "or run the job here with --local"
        ) from exc
    body = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    body["metadata"]["namespace"] = namespace
    api = client.CustomObjectsApi()
    host = api.api_client.configuration.host
    try:
        try:
            api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
            return "created"
        except ApiException as exc:
            if exc.status != 409:
                raise
        api.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, job.name, {"spec": body["spec"]}
        )
        return "configured"
    except ApiException as exc:
        raise ClusterError(_refusal(exc, host, namespace)) from exc
    except HTTPError as exc:
        raise ClusterError(f"cannot reach the cluster at {host}: {_first_line(exc)}") from exc


def _refusal(exc, host: str, namespace: str) -> str:
    if exc.status == 404:
        return (
            f"the cluster at {host} has no {PLURAL}.{GROUP} in namespace {namespace!r} (is the "
            f"CRD installed? {CHART_HINT}; does the namespace exist?)"
        )
    return f"the cluster at {host} refused the job: {exc.status} {exc.reason}: {_message(exc)}"


def _message(exc) -> str:
    """The API server's own words (a Status object's `message`), else the raw body."""
    import json

    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return _first_line(exc.body or "")


def _first_line(value: object) -> str:
    return str(value).strip().splitlines()[0] if str(value).strip() else ""


# ------------------------------------------------------------------ day-to-day commands

# --role: the pods (by lorarl.dev/role) and the container whose logs to show.
ROLE_PODS = {
    "trainer": ("trainer", "trainer"),
    "rollout": ("rollout", "engine"),
    "sidecar": ("rollout", "sidecar"),
    "reward": ("reward", "reward"),
}


class Cluster:
    """The current cluster (kubeconfig, or --kubeconfig) and namespace (the context's, or -n)."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | None = None):
        client, config = _client()
        from kubernetes.config.config_exception import ConfigException

        try:
            config.load_kube_config(config_file=kubeconfig)
            if namespace is None:
                _, context = config.list_kube_config_contexts(config_file=kubeconfig)
                namespace = context.get("context", {}).get("namespace", "default")
        except (ConfigException, OSError) as exc:
            raise ClusterError(
                f"no cluster configured ({exc}); point KUBECONFIG or --kubeconfig at one, "
                "or use --local for the runs on this machine"
            ) from exc
        self.namespace = namespace
        self.custom = client.CustomObjectsApi()
        self.core = client.CoreV1Api()
        self.host = self.custom.api_client.configuration.host

    def _call(self, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return fn(*args, **kwargs)
        except ApiException as exc:
            if exc.status == 404 and "name" in kwargs:
                raise ClusterError(self._not_found(kwargs["name"])) from exc
            raise ClusterError(_refusal(exc, self.host, self.namespace)) from exc
        except HTTPError as exc:
            raise ClusterError(
                f"cannot reach the cluster at {self.host}: {_first_line(exc)}"
            ) from exc

    def _not_found(self, name: str) -> str:
        names = [o["metadata"]["name"] for o in self.list()]  # no CRD: that error instead
        known = f"jobs: {', '.join(names)}" if names else "no jobs there"
        return f"no LoRARLJob named {name!r} in namespace {self.namespace!r}; {known}"

    def list(self, all_namespaces: bool = False) -> list[dict]:
        if all_namespaces:
            out = self._call(self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
        else:
            out = self._call(
                self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, PLURAL
            )
        return sorted(out.get("items", []), key=lambda o: o["metadata"]["name"])

    def get(self, name: str) -> dict:
        return self._call(
            self.custom.get_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name=name,
        )  # fmt: skip

    def set_suspend(self, name: str, suspend: bool) -> None:
        """`spec.runPolicy.suspend`: the operator deletes the pods and keeps the checkpoints;
        unsuspended, the trainer resumes from the newest one."""
        self.get(name)  # a one-line "no such job" before a patch that would say less
        self._call(
            self.custom.patch_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name=name,
            body={"spec": {"runPolicy": {"suspend": suspend}}},
        )  # fmt: skip

    def delete(self, name: str) -> None:
        self._call(
            self.custom.delete_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name=name,
        )  # fmt: skip

    def log_pods(self, name: str, role: str) -> tuple[builtins.list[str], str]:  # list: the method
        """The job's pods of a role (by label) and the container to read."""
        self.get(name)
        pod_role, container = ROLE_PODS[role]
        selector = f"lorarl.dev/job={name},lorarl.dev/role={pod_role}"
        pods = self._call(
            self.core.list_namespaced_pod, self.namespace, label_selector=selector
        ).items
        if not pods:
            raise ClusterError(
                f"job {name!r} has no {pod_role} pods in namespace {self.namespace!r} now "
                "(pending, suspended, or cleaned up after it finished: runPolicy.cleanPodPolicy)"
            )
        return sorted(p.metadata.name for p in pods), container

    def logs(self, pod: str, container: str, follow: bool = False):
        """The container's log, as one string, or (follow) a stream of byte chunks."""
        if not follow:
            return self._call(
                self.core.read_namespaced_pod_log, pod, self.namespace, container=container
            )
        resp = self._call(
            self.core.read_namespaced_pod_log, pod, self.namespace,
            container=container, follow=True, _preload_content=False,
        )  # fmt: skip
        return resp.stream()
