"""The one way manifests are read: YAML with limits, so hostile input gets a short error.

A job spec is about a hundred values. What is refused, before anything is built from it:
documents over 1 MiB (a ConfigMap's limit, which the rendered job must fit anyway), nesting
deeper than `MAX_DEPTH`, more than `MAX_NODES` values once YAML aliases are expanded (an "alias
bomb" of a few lines expands to millions), an integer longer than `MAX_INT_CHARS` (Python's
`int()` refuses one of more than 4,300 digits with a ValueError from inside the parser, and
takes quadratic time below that), and a key repeated in one mapping (YAML would keep the
last one silently). Depth and size are counted on the parser's event stream, stopping at the
first value over a limit, so neither a bomb nor deep brackets is ever built (a YAML parser slows
quadratically with depth, and Python's recursion would fail on it). `check_tree` applies the
same limits to an object that arrived as JSON (the webhook's AdmissionReview).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

import yaml

MAX_DOCUMENT_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 100_000
MAX_INT_CHARS = 100  # a job's integers fit in 64 bits (19 digits)
_INT_TAG = "tag:yaml.org,2002:int"
EXCERPT_CHARS = 200

_Parser = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present (faster)


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):  # type: ignore[misc]
    """SafeDumper (libyaml when present) that quotes every string a YAML 1.1 reader would take
    for a boolean. PyYAML already quotes `yes`/`no`/`on`/`off`; go-yaml (kubectl, Helm) also
    reads a bare `y`, `Y`, `n` or `N` as a boolean, so a CRD property `n:` reached the API server
    as a property named "false"."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))

# A float in exponent form without a dot or without an exponent sign (`1e-5`, `1.0e5`): YAML 1.1
# (PyYAML) reads it as a string, go-yaml (kubectl, Helm) and YAML 1.2 as a number. verl's configs
# write `lr: 1e-6`; the API server then sees a number, so lorarl must read one too (and quote
# such strings when it writes them, so go-yaml keeps them strings).
_FLOAT_TAG = "tag:yaml.org,2002:float"
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_Dumper.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+0123456789."))


def dump(data: Any, *, sort_keys: bool = True, width: int = 80) -> str:
    """YAML that PyYAML and go-yaml read alike (see `_Dumper`), through libyaml when present:
    the operator renders every job's config (and its size check) with it, ~4x faster than the
    pure-Python emitter. Everything lorarl writes as YAML goes through here."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=sort_keys, width=width)


class InputLimitError(ValueError):
    """A document over a size, depth or alias-expansion limit, or with a repeated key."""


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """`value` as JSON, cut to `limit` characters: what an error may echo of user input."""
    try:
        text = json.dumps(value, sort_keys=True, default=str)
    except (TypeError, ValueError, RecursionError):  # mixed key types, a cycle, too deep
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _long_int(node: yaml.Node) -> bool:
    return (
        isinstance(node, yaml.ScalarNode)
        and node.tag == _INT_TAG
        and len(node.value) > MAX_INT_CHARS
    )


def _long_int_error(node: yaml.Node, key: Any = None) -> InputLimitError:
    mark = node.start_mark
    field = f" for key {excerpt(key, 60)}" if key is not None else ""
    return InputLimitError(
        f"integer of {len(node.value)} characters{field} at line {mark.line + 1}, column "
        f"{mark.column + 1} (at most {MAX_INT_CHARS})"
    )


class _Loader(_Parser):  # type: ignore[misc, valid-type]
    """SafeLoader that refuses a key repeated in one mapping (merge keys `<<` may override) and
    an integer longer than `MAX_INT_CHARS`, before `int()` sees it."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if _long_int(node):
            raise _long_int_error(node)
        return super().construct_yaml_int(node)

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                if _long_int(value_node):  # name the key (the constructor only knows the line)
                    key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                    raise _long_int_error(value_node, key)
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                    seen.add(key)
                except TypeError:  # an unhashable key: the base class reports it
                    continue
                if repeated:
                    mark = key_node.start_mark
                    raise InputLimitError(
                        f"duplicate key {excerpt(key, 60)} at line {mark.line + 1}, column "
                        f"{mark.column + 1} (a key may appear once per mapping)"
                    )
        return super().construct_mapping(node, deep=deep)


_Loader.add_constructor(_INT_TAG, _Loader.construct_yaml_int)
_Loader.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+0123456789."))


def _check_events(text: str) -> None:
    """Depth and alias-expanded size (of all documents together) from the event stream,
    stopping at the first excess."""
    depth = 0
    sizes: list[int] = [0]  # values counted so far in each open collection
    anchored: dict[str, int] = {}  # anchor -> expanded size of its node
    anchors: list[str | None] = [None]
    try:
        for event in yaml.parse(text, Loader=_Parser):
            depth = _count(event, depth, sizes, anchored, anchors)
    except yaml.YAMLError as exc:
        # libyaml (PyYAML >= 6.0.4) has a nesting limit of its own, hit while scanning ahead of
        # the events counted here: the same refusal, with the same message.
        if "nesting depth" not in str(exc):
            raise
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark else ""
        raise InputLimitError(f"nesting deeper than {MAX_DEPTH} levels{where}") from None


def _count(
    event: yaml.Event,
    depth: int,
    sizes: list[int],
    anchored: dict[str, int],
    anchors: list[str | None],
) -> int:
    """One event of `_check_events`: the new depth; raises at the first excess."""
    if isinstance(event, yaml.CollectionStartEvent):
        depth += 1
        if depth > MAX_DEPTH:
            mark = event.start_mark  # the parser sets it; the stubs allow None
            where = f" (line {mark.line + 1})" if mark is not None else ""
            raise InputLimitError(f"nesting deeper than {MAX_DEPTH} levels{where}")
        sizes.append(1)
        anchors.append(event.anchor)
    elif isinstance(event, yaml.CollectionEndEvent):
        depth -= 1
        size, anchor = sizes.pop(), anchors.pop()
        if anchor:
            anchored[anchor] = size
        sizes[-1] += size
    elif isinstance(event, yaml.ScalarEvent):
        sizes[-1] += 1
        if event.anchor:
            anchored[event.anchor] = 1
    elif isinstance(event, yaml.AliasEvent):
        sizes[-1] += anchored.get(event.anchor, 1) if event.anchor else 1
    if sum(sizes) > MAX_NODES:
        raise InputLimitError(
            f"more than {MAX_NODES} values once YAML aliases are expanded (a job spec has "
            "about a hundred; keep large data in files)"
        )
    return depth


def load_all(text: str) -> list[Any]:
    """Every non-empty document in `text`; raises InputLimitError or yaml.YAMLError."""
    size = len(text.encode())
    if size > MAX_DOCUMENT_BYTES:
        raise InputLimitError(f"larger than {MAX_DOCUMENT_BYTES} bytes (1 MiB; got {size})")
    try:
        _check_events(text)
        return [d for d in yaml.load_all(text, Loader=_Loader) if d is not None]
    except RecursionError:  # cannot happen below MAX_DEPTH; a short error if it ever does
        raise InputLimitError(f"nesting deeper than {MAX_DEPTH} levels") from None


def _children(node: Any) -> Iterator[Any]:
    if isinstance(node, Mapping):
        yield from node.values()
    elif isinstance(node, list | tuple):
        yield from node


def check_tree(obj: Any) -> None:
    """The same depth and size limits for an already-parsed object (e.g. JSON); iterative."""
    stack = [(obj, 0)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise InputLimitError(f"more than {MAX_NODES} values")
        if isinstance(node, Mapping | list | tuple):
            if depth + 1 > MAX_DEPTH:
                raise InputLimitError(f"nesting deeper than {MAX_DEPTH} levels")
            stack.extend((child, depth + 1) for child in _children(node))
