"""What a refused manifest was probably meant to say, read from the CRD's own schema.

`lorarl validate` and the webhook refuse what the API server refuses: snake_case keys (the CRD
declares camelCase ones, and a strict apply refuses the rest), quoted numbers and booleans (the
CRD types them). This module adds the hint a person needs to fix each: the field a key was
probably meant to be (its camelCase spelling, a close spelling, the same name one level down,
or the lorarl field a verl or SkyRL parameter is), and the unquoted value. It also reads a
number as the API server does (`rank: 16.0` is the integer 16 there), so the strict check is
no stricter than the cluster.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from lorarl.api.porting import foreign_name

# Fuzzy matching and the walk of a mistaken subtree stay cheap on hostile input.
MAX_KEY_CHARS = 64
MAX_SUBTREE_LEAVES = 200
MAX_FOREIGN_SHOWN = 4
MAX_FIELDS_LISTED = 12

_INT = re.compile(r"[-+]?[0-9]+")
_FLOAT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_BOOLS = {"true": "true", "yes": "true", "on": "true", "false": "false", "no": "false",
          "off": "false"}  # fmt: skip


@functools.cache
def _schema() -> dict[str, Any]:
    from lorarl.api.crd import openapi_schema  # the models' schema, as the API server holds it

    return openapi_schema()


def _child(node: Mapping[str, Any] | None, part: str | int) -> Mapping[str, Any] | None:
    if not node:
        return None
    if isinstance(part, int):
        return node.get("items") if node.get("type") == "array" else None
    props = node.get("properties")
    if props is not None:
        return props.get(part)
    extra = node.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def _node_at(loc: Sequence[str | int]) -> Mapping[str, Any] | None:
    node: Mapping[str, Any] | None = _schema()
    for part in loc:
        node = _child(node, part)
    return node


def _props(node: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(node.get("properties") or {}) if node else {}


# --- numbers as the API server reads them --------------------------------------------------------


def _integer_typed(node: Mapping[str, Any]) -> bool:
    return node.get("type") == "integer" or bool(node.get("x-kubernetes-int-or-string"))


def as_served(doc: Any) -> Any:
    """`doc` with each whole float the schema types as an integer made an int (16.0 -> 16): the
    API server accepts `rank: 16.0` (kubectl sends it as 16), so validation must too. Copies
    only what it changes; `doc` itself is never modified."""
    return _served(doc, _schema())


def _served(value: Any, node: Mapping[str, Any] | None) -> Any:
    if node is None:
        return value
    if isinstance(value, float) and _integer_typed(node):
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        if not node.get("properties") and not isinstance(node.get("additionalProperties"), Mapping):
            return value  # free-form (reward params): the server keeps it as written
        out: dict[Any, Any] | None = None
        for key, item in value.items():
            child = _child(node, key) if isinstance(key, str) else None
            new = _served(item, child)
            if new is not item:
                out = dict(value) if out is None else out
                out[key] = new
        return value if out is None else out
    if isinstance(value, list) and node.get("type") == "array":
        items = node.get("items")
        new_items = [_served(item, items) for item in value]
        changed = any(a is not b for a, b in zip(new_items, value, strict=True))
        return new_items if changed else value
    return value


# --- quoted values -------------------------------------------------------------------------------


def quoted_value_hint(kind: str, value: Any) -> str:
    """For a string where the schema wants a number or boolean that the string spells: the
    words that say to drop the quotes; else ''."""
    if not isinstance(value, str) or len(value) > MAX_KEY_CHARS:
        return ""
    text = value.strip()
    if kind in ("int_type", "int_parsing") and _INT.fullmatch(text):
        return f", not a string: write {text} without quotes"
    number = kind in ("float_type", "float_parsing") and _FLOAT.fullmatch(text)
    if number and math.isfinite(float(text)):  # `1e999` is no number a manifest may hold
        return f", not a string: write {text} without quotes"
    if kind in ("bool_type", "bool_parsing") and text.lower() in _BOOLS:
        return f", not a string: write {_BOOLS[text.lower()]} without quotes"
    return ""


# --- unknown fields ------------------------------------------------------------------------------


def _norm(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


def _distance(a: str, b: str, limit: int) -> int:
    """Edit distance (insert, delete, substitute, swap two neighbours); limit + 1 once over."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i] + [0] * len(b)
        for j, cb in enumerate(b, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        if min(cur) > limit:
            return limit + 1
        prev2, prev = prev, cur
    return prev[-1]


def _allowed_distance(name: str) -> int:
    return 1 if len(name) <= 4 else 2 if len(name) <= 10 else 3


def _path(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _segments(loc: Sequence[str | int]) -> list[str]:
    out: list[str] = []
    for part in loc:
        if isinstance(part, str):
            out.extend(part.split("."))
    return out


def _descendants(
    node: Mapping[str, Any], prefix: str, depth: int = 1
) -> Iterator[tuple[str, str, int]]:
    """(name, path, depth) of every field under `node`, through objects only (not lists/maps)."""
    for name, child in _props(node).items():
        path = f"{prefix}.{name}" if prefix else name
        yield name, path, depth
        yield from _descendants(child, path, depth + 1)


def _flatten(value: Any, prefix: list[str]) -> Iterator[list[str]]:
    """The key paths of a mapping's leaves (dotted keys split), at most MAX_SUBTREE_LEAVES."""
    count = 0
    stack = [(value, prefix)]
    while stack and count < MAX_SUBTREE_LEAVES:
        node, path = stack.pop()
        if isinstance(node, Mapping) and node and len(path) < 16:
            for key, item in reversed(list(node.items())[:MAX_SUBTREE_LEAVES]):
                if isinstance(key, str) and len(key) <= MAX_KEY_CHARS:
                    stack.append((item, [*path, *key.split(".")]))
        else:
            count += 1
            yield path


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _foreign(
    segments: list[str], where: list[str]
) -> tuple[str, str | None, tuple[str, ...], str] | None:
    """(name as matched, lorarl field or None, frameworks, note) for a verl/SkyRL path."""
    match = foreign_name(segments)
    if match is None:
        return None
    suffix, entries = match

    def closeness(entry) -> int:  # the entry whose field lies nearest where the key was written
        return _common(where, entry.field.split(".")[:-1]) if entry.field else 0

    best = max(entries, key=closeness)  # the first of equals: the table puts the actor's first
    same = [e for e in entries if e.field == best.field]
    return suffix, best.field, tuple(dict.fromkeys(e.framework for e in same)), best.note


def _whose(frameworks: Sequence[str]) -> str:
    return " and ".join(f"{f}'s" for f in dict.fromkeys(frameworks))


def _foreign_hint(found: tuple[str, str | None, tuple[str, ...], str]) -> str:
    suffix, field, names, note = found
    frameworks = _whose(names)
    if field is None:
        return f"{frameworks} {suffix} has no lorarl equivalent: {note}"
    tail = f", {note}" if note else ""
    return f"did you mean {field}? that is {frameworks} {suffix}{tail}"


# A Secret or ConfigMap reference's own fields: `spec.model.name` is not meant to be
# spec.model.hub.tokenSecret.name, whatever the spelling says.
_REFERENCE_FIELDS = frozenset(("name", "key", "optional"))


def unknown_field_hint(loc: Sequence[str | int], value: Any) -> str:
    """What the key at `loc` (refused as unknown) was probably meant to be: a parenthesis to
    append to the problem, or ''."""
    if not loc or not isinstance(loc[-1], str):
        return ""
    key, parent_loc = loc[-1], list(loc[:-1])
    parent = _node_at(parent_loc)
    siblings = list(_props(parent))
    if not siblings or len(key) > MAX_KEY_CHARS:
        return ""
    where = [p for p in parent_loc if isinstance(p, str)]
    # 1. The same name in another spelling: snake_case, kebab-case, PascalCase.
    for name in siblings:
        if _norm(name) == _norm(key):
            why = " manifest fields are camelCase" if ("_" in key or "-" in key) else ""
            return f"(did you mean {name}?{why})"
    # 2. A verl or SkyRL parameter, written as a leaf or as a tree of them.
    if isinstance(value, Mapping) and value:
        found = []
        for path in _flatten(value, _segments(loc)):
            match = _foreign(path, where)
            if match is not None and match not in found:
                found.append(match)
        if found:
            shown = [f"{s} is {f}" if f else f"{s} has no equivalent" for s, f, _, _ in found]
            if len(found) > MAX_FOREIGN_SHOWN:
                shown = [*shown[:MAX_FOREIGN_SHOWN], f"and {len(found) - MAX_FOREIGN_SHOWN} more"]
            frameworks = _whose([fw for _, _, names, _ in found for fw in names])
            return f"({frameworks} settings: {', '.join(shown)})"
    else:
        match = _foreign(_segments(loc), where)
        if match is not None:
            return f"({_foreign_hint(match)})"
    # 3. A field of a section below (`spec.rank` for spec.lora.rank), then 4. a close spelling of
    # a field here, then 5. a close spelling of one below.
    norm = _norm(key)
    limit = _allowed_distance(norm)
    below = [
        (_distance(norm, _norm(name), limit), depth, path)
        for name, path, depth in _descendants(parent or {}, _path(parent_loc))
        if depth > 1 and name not in _REFERENCE_FIELDS
    ]
    here = [(_distance(norm, _norm(name), limit), 0, name) for name in siblings]
    for candidates, exact in ((below, True), (here, False), (below, False)):
        near = sorted(c for c in candidates if (c[0] == 0) == exact and c[0] <= limit)
        if near:
            best = [name for d, depth, name in near if (d, depth) == near[0][:2]][:2]
            return f"(did you mean {' or '.join(best)}?)"
    if len(siblings) <= MAX_FIELDS_LISTED:
        return f"(known fields: {', '.join(siblings)})"
    return ""
