"""Label and field selectors (`?labelSelector=`, `?fieldSelector=`) as the API server reads them."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ApiError, bad_request

_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"
_VALUE = r"[-A-Za-z0-9_.]*"
_SET_RE = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^)]*)\)$")
_EQ_RE = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|!=|=)\s*(?P<value>{_VALUE})$")
_EXISTS_RE = re.compile(rf"^(?P<neg>!?)\s*(?P<key>{_KEY})$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # '=', '!=', 'in', 'notin', 'exists', '!exists'
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value in self.values
        if self.op == "in":
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        return not present  # '!exists'


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside `in (a,b)` parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse `a=b,c!=d,e in (x,y),f notin (z),g,!h`; a malformed term is a 400 naming it."""
    reqs: list[Requirement] = []
    for term in _split_top_level(text or ""):
        if m := _SET_RE.match(term):
            values = frozenset(v.strip() for v in m["values"].split(",") if v.strip())
            reqs.append(Requirement(m["key"], m["op"], values))
        elif m := _EQ_RE.match(term):
            op = "!=" if m["op"] == "!=" else "="
            reqs.append(Requirement(m["key"], op, frozenset({m["value"]})))
        elif m := _EXISTS_RE.match(term):
            reqs.append(Requirement(m["key"], "!exists" if m["neg"] else "exists"))
        else:
            raise bad_request(
                f"unable to parse requirement: labelSelector term {term!r} is invalid"
            )
    return reqs


def labels_match(reqs: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


# Field selectors the real API server accepts per resource (beyond metadata.name/namespace).
_FIELDS_BY_RESOURCE: dict[tuple[str, str], frozenset[str]] = {
    ("", "pods"): frozenset(
        {
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
    ("", "events"): frozenset(
        {
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        }
    ),
    ("", "namespaces"): frozenset({"status.phase"}),
    ("", "secrets"): frozenset({"type"}),
}
_UNIVERSAL_FIELDS = frozenset({"metadata.name", "metadata.namespace"})


@dataclass(frozen=True)
class FieldRequirement:
    path: str
    negate: bool
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        cur: Any = obj
        for part in self.path.split("."):
            cur = cur.get(part) if isinstance(cur, Mapping) else None
        actual = "" if cur is None else (str(cur).lower() if isinstance(cur, bool) else str(cur))
        return (actual == self.value) != self.negate


def parse_field_selector(
    text: str | None, group: str, plural: str, extra_fields: frozenset[str] = frozenset()
) -> list[FieldRequirement]:
    """Parse `metadata.name=x,status.phase!=Running`; fields the API would reject are a 400."""
    per_resource = _FIELDS_BY_RESOURCE.get((group, plural), frozenset())
    allowed = _UNIVERSAL_FIELDS | per_resource | extra_fields
    reqs: list[FieldRequirement] = []
    for term in _split_top_level(text or ""):
        m = re.match(r"^([^=!]+?)\s*(==|!=|=)\s*(.*)$", term)
        if not m:
            raise bad_request(
                f"invalid fieldSelector term {term!r}: expected key=value or key!=value"
            )
        path = m[1].strip()
        if path not in allowed:
            raise ApiError(400, "BadRequest", f"field label not supported: {path}")
        reqs.append(FieldRequirement(path, m[2] == "!=", m[3].strip()))
    return reqs


def fields_match(reqs: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all(r.matches(obj) for r in reqs)


def make_filter(
    label_selector: str | None,
    field_selector: str | None,
    group: str,
    plural: str,
    extra_fields: frozenset[str] = frozenset(),
) -> Callable[[Mapping[str, Any]], bool]:
    """One predicate for both selectors, parsed once per request."""
    labels = parse_label_selector(label_selector)
    fields = parse_field_selector(field_selector, group, plural, extra_fields)
    return lambda obj: labels_match(labels, obj) and fields_match(fields, obj)
