"""`lorarl run JOB` without --local: create (or update) the LoRARLJob in the current cluster.

The `kubernetes` client comes with the operator extra only, so a base install gets a one-line
ClusterError naming the extra; so do a missing kubeconfig, an unreachable API server and a cluster
that refuses the object (e.g. no CRD installed).
"""

from __future__ import annotations

from lorarl.api.job import GROUP, PLURAL, VERSION, LoRARLJob
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
