"""The JSONPath subset used by CRD `additionalPrinterColumns` (`.status.phase`,
`.spec.items[0].name`, `.items[*].x`, `.status.conditions[?(@.type=="Ready")].status`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_FILTER_RE = re.compile(
    r'^\?\(@((?:\.[A-Za-z0-9_-]+)+)\s*(==|!=)\s*(?:"([^"]*)"|\'([^\']*)\'|([-0-9.]+|true|false))\)$'
)
_FIELD_RE = re.compile(r"\.([A-Za-z0-9_-]+)")


@dataclass(frozen=True)
class _Step:
    kind: str  # 'field' | 'index' | 'all' | 'filter'
    key: Any = None
    op: str = ""
    value: Any = None


def compile_path(path: str) -> list[_Step]:
    """Parse once; a malformed path is a ValueError naming the offending part."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    steps: list[_Step] = []
    pos = 0
    while pos < len(text):
        if m := _FIELD_RE.match(text, pos):
            steps.append(_Step("field", m[1]))
            pos = m.end()
        elif text[pos] == "[":
            end = _closing_bracket(text, pos)
            steps.append(_bracket_step(text[pos + 1 : end], path))
            pos = end + 1
        else:
            raise ValueError(f"jsonPath {path!r}: unexpected {text[pos:]!r}")
    return steps


def _closing_bracket(text: str, start: int) -> int:
    depth = 0
    for i in range(start, len(text)):
        depth += (text[i] == "[") - (text[i] == "]")
        if depth == 0:
            return i
    raise ValueError(f"jsonPath {text!r}: unbalanced brackets")


def _bracket_step(inner: str, path: str) -> _Step:
    inner = inner.strip()
    if inner == "*":
        return _Step("all")
    if re.fullmatch(r"-?\d+", inner):
        return _Step("index", int(inner))
    if len(inner) >= 2 and inner[0] == inner[-1] and inner[0] in "'\"":
        return _Step("field", inner[1:-1])
    if m := _FILTER_RE.match(inner):
        raw = m[3] if m[3] is not None else m[4] if m[4] is not None else m[5]
        value: Any = raw
        if m[5] is not None:
            value = {"true": True, "false": False}.get(raw)
            if value is None:
                value = float(raw) if "." in raw else int(raw)
        return _Step("filter", m[1][1:].split("."), m[2], value)
    raise ValueError(f"jsonPath {path!r}: unsupported expression [{inner}]")


def find(obj: Any, path: str | list[_Step]) -> list[Any]:
    """All values the path selects (possibly none)."""
    nodes = [obj]
    for step in compile_path(path) if isinstance(path, str) else path:
        nodes = [child for node in nodes for child in _apply(step, node)]
    return nodes


def _apply(step: _Step, node: Any) -> list[Any]:
    if step.kind == "field":
        return [node[step.key]] if isinstance(node, dict) and step.key in node else []
    if not isinstance(node, list):
        return list(node.values()) if step.kind == "all" and isinstance(node, dict) else []
    if step.kind == "index":
        return [node[step.key]] if -len(node) <= step.key < len(node) else []
    if step.kind == "all":
        return list(node)
    return [item for item in node if _filter_matches(step, item)]


def _filter_matches(step: _Step, item: Any) -> bool:
    cur = item
    for key in step.key:
        if not isinstance(cur, dict) or key not in cur:
            return False
        cur = cur[key]
    return (cur == step.value) == (step.op == "==")
