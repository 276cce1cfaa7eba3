"""`$(VAR)` expansion as the kubelet does it, so local runs start what a pod would."""

from __future__ import annotations

from lorarl.local.env_refs import expand, expand_env


def test_defined_references_expand_and_undefined_ones_stay():
    env = {"KEY": "s3cret", "PORT": "8000"}
    assert expand("--api-key=$(KEY)", env) == "--api-key=s3cret"
    assert expand("$(KEY):$(PORT)", env) == "s3cret:8000"
    assert expand("$(MISSING)", env) == "$(MISSING)"


def test_double_dollar_escapes_a_reference():
    assert expand("$$(KEY) costs $$5", {"KEY": "x"}) == "$(KEY) costs $5"


def test_text_without_references_is_unchanged():
    for text in ("plain", "$KEY", "$(", "${KEY}", "$(1BAD)"):
        assert expand(text, {"KEY": "x", "1BAD": "y"}) == text


def test_env_values_expand_against_what_is_defined():
    assert expand_env({"A": "$(K)", "B": "b"}, {"K": "k"}) == {"A": "k", "B": "b"}
