"""The validating admission webhook: `lorarl validate`'s rules at `kubectl apply`, and no edits
to a running job's fields that cannot take effect. Served at `/validate-lorarljob`."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.operator.admission import manifest_problems, update_refusal
from lorarl.operator.handlers.common import CONFIG, JOBS
from lorarl.operator.reconciler import plain


def validate_lorarljob(
    body: kopf.Body, old: Any, operation: str, subresource: str | None = None, **_: Any
) -> None:
    if subresource:
        return  # status and scale writes carry no user spec to validate
    new = plain(body)
    problems = manifest_problems(new)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)
    if operation == "UPDATE" and old:
        refusal = update_refusal(plain(old), new)
        if refusal:
            raise kopf.AdmissionError(refusal, code=422)


# kopf refuses to start with admission handlers but no server: register only when it is on.
# subresource="*": API servers omit `subResource` for the main resource, but some send "", which
# kopf would not match to None.
if CONFIG.webhook_port:
    kopf.on.validate(
        *JOBS, id="validate-lorarljob", operations=["CREATE", "UPDATE"], subresource="*"
    )(validate_lorarljob)
