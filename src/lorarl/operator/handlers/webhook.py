"""The validating admission webhook: `lorarl validate`'s rules at `kubectl apply`, and no edits
to a running job's fields that cannot take effect. Served at `/validate-lorarljob`."""

from __future__ import annotations

from typing import Any

import kopf

from lorarl.api.safe_yaml import InputLimitError, check_tree
from lorarl.operator.admission import manifest_problems, update_refusal
from lorarl.operator.handlers.common import CONFIG, JOBS
from lorarl.operator.parsing import plain


def validate_lorarljob(body: kopf.Body, old: Any, operation: str, **_: Any) -> None:
    try:
        check_tree(body)  # before anything walks it recursively
    except InputLimitError as exc:
        raise kopf.AdmissionError(f"manifest refused: {exc}", code=422) from None
    new = plain(body)
    problems = manifest_problems(new, CONFIG.allowed_priority_classes)
    if problems:
        raise kopf.AdmissionError("; ".join(str(p) for p in problems), code=422)
    if operation == "UPDATE" and old:
        refusal = update_refusal(plain(old), new)
        if refusal:
            raise kopf.AdmissionError(refusal, code=422)


# kopf refuses to start with admission handlers but no server: register only when it is on.
# No `subresource`: kopf then matches only reviews without `subResource` (the main resource), so
# status and scale writes, which carry no user spec, are allowed without being validated.
if CONFIG.webhook_port:
    kopf.on.validate(*JOBS, id="validate-lorarljob", operations=["CREATE", "UPDATE"])(
        validate_lorarljob
    )
