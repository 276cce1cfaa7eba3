"""Turn manifests into LoRARLJobs, or into problems a person can act on.

Every problem names the field path, the rule and the value, e.g.
`spec.lora.rank: must be greater than 0 (got 0)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from lorarl.api.hints import as_served, quoted_value_hint, unknown_field_hint
from lorarl.api.resource import LoRARLJob
from lorarl.api.rules import CLUSTER, CRD_ONLY
from lorarl.api.safe_yaml import (
    EXCERPT_CHARS,
    MAX_DOCUMENT_BYTES,
    InputLimitError,
    check_tree,
    excerpt,
    load_all,
)
from lorarl.api.tenancy import TenancyPolicy, policy_findings

# More problems than this in one manifest are summarized (a hostile one can make thousands).
MAX_PROBLEMS = 20


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


@dataclass(frozen=True)
class ManifestResult:
    source: str  # file name plus document index for multi-document files
    job: LoRARLJob | None
    problems: list[Problem]

    @property
    def ok(self) -> bool:
        return not self.problems


def parse_job(doc: Any, *, cluster: bool = False) -> LoRARLJob:
    """Validate one manifest; raises ManifestError listing every problem. `cluster` adds the
    rules of jobs that run as pods (what the webhook and the operator enforce)."""
    job, problems = _check(doc, _context(cluster))
    if job is None:
        raise ManifestError(problems)
    return job


class ManifestError(ValueError):
    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("; ".join(str(p) for p in problems))


def _context(cluster: bool) -> dict[str, bool] | None:
    return CLUSTER if cluster else None


def check_manifest(doc: Any, *, cluster: bool = True, crd_only: bool = False) -> list[Problem]:
    """What the cluster (CRD, webhook) says about a manifest; `cluster=False` for a local run,
    `crd_only` for the CRD alone (without the webhook's Python-only rules)."""
    return _check(doc, CRD_ONLY if crd_only else _context(cluster))[1]


def validate_manifest(doc: Any, context: dict[str, bool] | None) -> LoRARLJob:
    """The one validation of what a person wrote (`lorarl validate`, `run`, `plan`, the webhook,
    the rendered config every process reads): typed as the CRD types it. Keys are the camelCase
    names only (`total_steps` is refused, as the API server refuses it; Python code may still
    construct models by field name), and no string stands in for a number or boolean
    (`rank: "16"` is refused, where pydantic's lax mode would read 16). Raises ValidationError."""
    return LoRARLJob.model_validate(
        as_served(doc), strict=True, by_alias=True, by_name=False, context=context
    )


def _check(doc: Any, context: dict[str, bool] | None) -> tuple[LoRARLJob | None, list[Problem]]:
    """(the job, []) or (None, its problems)."""
    if not isinstance(doc, dict):
        return None, [Problem("", f"a manifest must be a mapping (got {_show(doc)})")]
    try:
        check_tree(doc)
        return validate_manifest(doc, context), []
    except InputLimitError as exc:
        return None, [Problem("", f"manifest refused: {exc}")]
    except RecursionError:  # check_tree bounds the depth; kept so no input can crash a caller
        return None, [Problem("", "manifest refused: nested too deeply")]
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        problems = [_problem(err) for err in errors[:MAX_PROBLEMS]]
        if len(errors) > MAX_PROBLEMS:
            more = len(errors) - MAX_PROBLEMS
            problems.append(Problem("", f"... and {more} more problems"))
        return None, problems


def load_documents(path: str | Path) -> list[tuple[str, Any]]:
    """(source label, parsed document) for each YAML document; a YAML error becomes a Problem."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_DOCUMENT_BYTES + 1)  # no more than the limit is ever read
        text = data.decode()
    except OSError as exc:
        raise ManifestError([Problem("", f"cannot read {path}: {exc.strerror}")]) from exc
    except UnicodeDecodeError as exc:
        raise ManifestError([Problem("", f"{path} is not UTF-8 text ({exc.reason})")]) from None
    try:
        docs = load_all(text)
    except InputLimitError as exc:
        raise ManifestError([Problem("", f"YAML refused: {exc}")]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = str(getattr(exc, "problem", None) or exc)[:EXCERPT_CHARS]
        raise ManifestError([Problem("", f"invalid YAML{where}: {reason}")]) from None
    if not docs:
        raise ManifestError([Problem("", "no YAML documents found")])
    if len(docs) == 1:
        return [(str(path), docs[0])]
    return [(f"{path}[{i}]", d) for i, d in enumerate(docs)]


def admin_problems(job: LoRARLJob, policy: TenancyPolicy) -> list[Problem]:
    """What the cluster admin's policy (allowed Secrets, control-plane nodes) refuses in a
    valid job: the webhook's words, and `lorarl validate`'s with the policy it is given."""
    return [Problem(path, message) for path, message in policy_findings(job, policy)]


def validate_file(path: str | Path, *, cluster: bool = True) -> list[ManifestResult]:
    try:
        docs = load_documents(path)
    except ManifestError as exc:
        return [ManifestResult(str(path), None, exc.problems)]
    results = []
    for source, doc in docs:
        job, problems = _check(doc, _context(cluster))
        results.append(ManifestResult(source, job, problems))
    return results


_MESSAGES = {
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be greater than or equal to {ge}",
    "less_than": "must be less than {lt}",
    "less_than_equal": "must be less than or equal to {le}",
    "missing": "required field is missing",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "int_parsing_size": "must be an integer of at most 4300 digits",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a mapping",
    "model_type": "must be a mapping",
    "model_attributes_type": "must be a mapping",
    "string_pattern_mismatch": "must match the pattern {pattern}",
    "string_too_short": "must have at least {min_length} characters",
    "string_too_long": "must have at most {max_length} characters",
    "too_short": "must have at least {min_length} items",
    "too_long": "must have at most {max_length} items",
    "literal_error": "must be one of {expected}",
}


def _problem(err: ErrorDetails) -> Problem:
    loc = [str(p) for p in err["loc"]]
    ctx = err.get("ctx") or {}
    kind = err["type"]
    if kind == "rule":
        if not ctx.get("field"):
            return Problem(_join(loc), ctx["message"])
        loc.append(ctx["field"])
        return Problem(_join(loc), f"{ctx['message']} (got {_show(ctx.get('value'))})")
    template = _MESSAGES.get(kind)
    shown = {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}
    message = template.format(**shown) if template else err["msg"]
    if kind == "extra_forbidden":
        hint = unknown_field_hint(err["loc"], err.get("input"))
        return Problem(_join(loc), f"{message} {hint}" if hint else message)
    if kind != "missing":
        hint = quoted_value_hint(kind, err.get("input"))
        message = f"{message}{hint} (got {_show(err.get('input'))})"
    return Problem(_join(loc), message)


def _join(loc: list[str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def _show(value: Any) -> str:
    return excerpt(value)


def load_job_file(path: str | Path) -> LoRARLJob:
    """The one job in a rendered config file (what every process of a job reads at start). The
    cluster rules were checked where the job was admitted; a local run's config has no volume."""
    docs = load_documents(path)
    if len(docs) != 1:
        raise ManifestError([Problem("", f"{path}: expected one job, found {len(docs)}")])
    return parse_job(docs[0][1])
