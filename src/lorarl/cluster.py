"""`lorarl run JOB` without --local: create (or update) the LoRARLJob in the current cluster."""

from __future__ import annotations

from lorarl.api.job import GROUP, PLURAL, VERSION, LoRARLJob


def apply_job(job: LoRARLJob, namespace: str | None = None, kubeconfig: str | None = None) -> str:
    """Create the job, or replace its spec if it exists; returns 'created' or 'configured'."""
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    config.load_kube_config(config_file=kubeconfig)
    if namespace is None:
        namespace = job.metadata.namespace
    if namespace is None:
        _, context = config.list_kube_config_contexts(config_file=kubeconfig)
        namespace = context.get("context", {}).get("namespace", "default")
    body = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    body["metadata"]["namespace"] = namespace
    api = client.CustomObjectsApi()
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
