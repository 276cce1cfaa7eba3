"""The validating admission webhook: `lorarl validate`'s rules at `kubectl apply`, the cluster
admin's (PriorityClasses, Secrets, control-plane nodes), an outputDir no other live job of the
namespace uses, and no edits to a running job's fields that cannot take effect. Served at
`/validate-lorarljob`."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf

from lorarl.api.resource import GROUP, PLURAL, VERSION
from lorarl.api.safe_yaml import InputLimitError, check_tree
from lorarl.operator.admission import (
    manifest_problems,
    output_dir_changed,
    output_dir_problems,
    update_refusal,
    user_fields_changed,
)
from lorarl.operator.handlers.common import CONFIG, JOBS
from lorarl.operator.kube import KubeError, path
from lorarl.operator.parsing import plain


def validate_lorarljob(body: kopf.Body, old: Any, operation: str | None, **_: Any) -> None:
    """Every rule the manifest alone (and the operator's config) decides."""
    try:
        check_tree(body)  # before anything walks it recursively
    except InputLimitError as exc:
        raise kopf.AdmissionError(f"manifest refused: {exc}", code=422) from None
    new = plain(body)
    if operation == "UPDATE" and old and not user_fields_changed(plain(old), new):
        return  # metadata only: nothing the user wrote changed
    problems = manifest_problems(new, CONFIG.allowed_priority_classes, CONFIG.tenancy)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)
    if operation == "UPDATE" and old:
        refusal = update_refusal(plain(old), new)
        if refusal:
            raise kopf.AdmissionError(refusal, code=422)


async def refuse_shared_output(body: Any, old: Any, kube: Any) -> None:
    """The namespace's other live jobs must not write where this one will: listed from the API
    server (the chart's RBAC lets the operator list LoRARLJobs), so a job applied just before
    counts. If the list cannot be read, the job is refused: nothing is created unchecked."""
    new = plain(body)
    if not output_dir_changed(plain(old) if old else None, new):
        return
    namespace = (new.get("metadata") or {}).get("namespace") or "default"
    try:
        listing = await kube.get(path(f"{GROUP}/{VERSION}", PLURAL, namespace))
    except KubeError as exc:
        raise kopf.AdmissionError(
            f"spec.training.outputDir: could not be checked against the other jobs of "
            f"namespace {namespace} ({exc}); try again",
            code=503,
        ) from None
    problems = output_dir_problems(new, (listing or {}).get("items") or [])
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)


async def admit_lorarljob(
    body: kopf.Body,
    memo: kopf.Memo,
    old: kopf.Body | None = None,
    operation: str | None = None,
    **_: Any,
) -> None:
    # kopf passes `old` and `operation` to every admission handler, though its WebhookFn
    # protocol does not list them (so they are declared optional).
    # The validation is CPU work (pydantic, a YAML render): off the loop the reconciler runs on.
    await asyncio.to_thread(validate_lorarljob, body=body, old=old, operation=operation)
    await refuse_shared_output(body, old if operation == "UPDATE" else None, memo["kube"])


# kopf refuses to start with admission handlers but no server: register only when it is on.
# No `subresource`: kopf then matches only reviews without `subResource` (the main resource), so
# status and scale writes, which carry no user spec, are allowed without being validated.
if CONFIG.webhook_port:
    kopf.on.validate(*JOBS, id="validate-lorarljob", operations=["CREATE", "UPDATE"])(
        admit_lorarljob
    )
