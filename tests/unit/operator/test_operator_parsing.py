"""The operator's copy and parse of a job body survive input the webhook would have refused:
with the webhook off, the API server stores `reward.params` (schemaless) nested thousands deep."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from lorarl.api.validation import ManifestError
from lorarl.operator.parsing import parsed, plain

ROOT = Path(__file__).resolve().parents[3]


def _nested(depth: int) -> dict:
    node: dict = {"leaf": [1, "x", None]}
    for i in range(depth):
        node = {"k": node, "list": [i, {"i": i}]}
    return node


def _body(params: dict) -> dict:
    doc = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    doc["metadata"] = {"name": "deep", "namespace": "default", "uid": "u1"}
    doc["spec"]["reward"] = {"function": "exact_match", "params": params}
    return doc


def test_plain_copies_deep_structures_without_recursion_and_keeps_order():
    shallow = _nested(300)
    assert plain(shallow) == shallow and plain(shallow) is not shallow
    node, depth = plain(_nested(5000)), 0  # `==` itself would recurse: walk it
    while "k" in node:
        assert node["list"] == [4999 - depth, {"i": 4999 - depth}]
        node, depth = node["k"], depth + 1
    assert depth == 5000 and node == {"leaf": [1, "x", None]}
    assert plain({"a": (1, [2, {"b": 3}])}) == {"a": [1, [2, {"b": 3}]]}
    assert plain(7) == 7


def test_a_spec_nested_too_deeply_is_a_manifest_error_not_a_crash():
    body = _body(_nested(5000))
    with pytest.raises(ManifestError) as err:
        parsed(body, None)
    assert str(err.value).startswith("spec: manifest refused: nesting deeper than")
    assert len(str(err.value)) < 200


def test_a_normal_spec_still_parses_and_is_cached():
    body = _body({})
    body["spec"]["reward"].pop("params")
    first = parsed(body, None)
    assert parsed(copy.deepcopy(body), first) is first
