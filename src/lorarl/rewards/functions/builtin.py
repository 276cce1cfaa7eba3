"""Built-in verifiable rewards needing no model: text, choices, regex, JSON, length, format.

Every reward returns 1.0 for a pass and 0.0 for a fail, except `length_penalty`, which is 0.0 or
negative so that it can be added to another reward with `weighted`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lorarl.rewards.registry import RewardResult, register

__all__ = [
    "exact_match",
    "extract_choice",
    "format_reward",
    "json_valid",
    "length_penalty",
    "multiple_choice",
    "normalize_text",
    "regex_match",
]

_TRAILING_PUNCT = ".,;:!?。"


def normalize_text(s: str) -> str:
    """Strip, case-fold, collapse whitespace, drop trailing sentence punctuation."""
    s = re.sub(r"\s+", " ", s.strip().casefold())
    return s.rstrip(_TRAILING_PUNCT).rstrip()


def _need_truth(name: str, ground_truth: str | None) -> str:
    if ground_truth is None:
        raise ValueError(f"{name} needs a ground truth (set the dataset's answer key)")
    return str(ground_truth)


@register("exact_match")
def exact_match(
    prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
) -> RewardResult:
    truth = _need_truth("exact_match", ground_truth)
    got, want = normalize_text(completion), normalize_text(truth)
    return RewardResult(float(got == want), {"normalized": got})


def extract_choice(text: str, choices: str = "ABCDE") -> str | None:
    """The final letter choice: an explicit "answer is (B)" wins, else the last marked letter.

    A bare capital letter inside prose ("A cat") is not a choice; it must be marked: "(B)", "B.",
    "B)", "B:", "**C**", or stand alone on a line.
    """
    letters = re.escape(choices)
    explicit = re.findall(
        rf"(?i:answer)\s*(?i:is|:)?\s*[:\-]?\s*(?:\*\*)?\s*\(?\s*([{letters}])\s*\)?(?![A-Za-z0-9])",
        text,
    )
    if explicit:
        return explicit[-1]
    marked = re.compile(
        rf"\(([{letters}])\)"  # (B)
        rf"|\*\*\s*\(?([{letters}])\)?[.):]?\s*\*\*"  # **C**, **(C)**
        rf"|(?<![A-Za-z0-9])([{letters}])[.):](?=\s|$)"  # B.  B)  B:
        rf"|^\s*([{letters}])\s*$",  # a line that is just the letter
        flags=re.MULTILINE,
    )
    found = [next(g for g in m.groups() if g) for m in marked.finditer(text)]
    return found[-1] if found else None


@register("multiple_choice")
def multiple_choice(
    prompt: str,
    completion: str,
    ground_truth: str | None,
    metadata: Mapping[str, Any],
    *,
    choices: str = "ABCDE",
) -> RewardResult:
    truth_text = _need_truth("multiple_choice", ground_truth).strip()
    bare = truth_text.strip("()*.: ").upper()  # "B", "(b)", "**B**"
    truth = bare if len(bare) == 1 else extract_choice(truth_text, choices)
    if truth is None or truth not in choices:
        raise ValueError(f"multiple_choice: ground truth {truth_text!r} is not one of {choices}")
    got = extract_choice(completion, choices)
    return RewardResult(float(got == truth), {"extracted": got, "truth": truth})


_REGEX_MODES = ("search", "full")


def _check_regex(
    *,
    pattern: str | None = None,
    mode: str = "search",
    ignore_case: bool = False,
    metadata_key: str = "pattern",
) -> None:
    if mode not in _REGEX_MODES:
        raise ValueError(f"regex_match: mode must be one of {_REGEX_MODES}, got {mode!r}")
    if pattern is not None:
        _compile(pattern, ignore_case, "pattern")


def _compile(pattern: Any, ignore_case: bool, where: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ValueError(f"regex_match: {where} must be a string, got {type(pattern).__name__}")
    try:
        return re.compile(pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise ValueError(f"regex_match: invalid {where} {pattern!r}: {exc}") from exc


@register("regex_match", check=_check_regex)
def regex_match(
    prompt: str,
    completion: str,
    ground_truth: str | None,
    metadata: Mapping[str, Any],
    *,
    pattern: str | None = None,
    mode: str = "search",
    ignore_case: bool = False,
    metadata_key: str = "pattern",
) -> RewardResult:
    """1.0 when the pattern matches. `mode="search"`: anywhere in the completion (re.search);
    `mode="full"`: the whole completion, surrounding whitespace stripped (re.fullmatch).
    The pattern comes from params, else from `metadata[metadata_key]` (a per-row pattern)."""
    where = "pattern"
    if pattern is None:
        pattern = metadata.get(metadata_key)
        where = f"metadata[{metadata_key!r}]"
        if pattern is None:
            raise ValueError(
                f"regex_match: no pattern given as a parameter or in metadata[{metadata_key!r}]"
            )
    compiled = _compile(pattern, ignore_case, where)
    if mode == "full":
        matched = compiled.fullmatch(completion.strip()) is not None
    elif mode == "search":
        matched = compiled.search(completion) is not None
    else:
        raise ValueError(f"regex_match: mode must be one of {_REGEX_MODES}, got {mode!r}")
    return RewardResult(float(matched), {"pattern": pattern})


_FENCE_RE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*?)\n?```$", re.DOTALL)


@register("json_valid")
def json_valid(
    prompt: str,
    completion: str,
    ground_truth: str | None,
    metadata: Mapping[str, Any],
    *,
    required_keys: Sequence[str] = (),
    strip_code_fence: bool = True,
) -> RewardResult:
    """1.0 when the completion (optionally inside one ``` fence) is JSON with the required keys.

    Required keys are top-level keys of an object; any other JSON value fails when keys are set.
    """
    if isinstance(required_keys, str):
        raise ValueError("json_valid: required_keys must be a list of strings, not a string")
    text = completion.strip()
    fence = _FENCE_RE.match(text) if strip_code_fence else None
    if fence:
        text = fence.group(1).strip()
    try:
        value = json.loads(text)
    except ValueError as exc:
        return RewardResult(0.0, {"error": f"invalid JSON: {exc}"})
    if not required_keys:
        return RewardResult(1.0, {})
    if not isinstance(value, dict):
        return RewardResult(0.0, {"error": f"expected an object, got {type(value).__name__}"})
    missing = [k for k in required_keys if k not in value]
    return RewardResult(float(not missing), {"missing_keys": missing} if missing else {})


def _check_length(*, target: int, window: int | None = None, unit: str = "chars") -> None:
    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise ValueError(f"length_penalty: target must be an integer >= 0, got {target!r}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window <= 0
    ):
        raise ValueError(f"length_penalty: window must be an integer > 0, got {window!r}")
    if unit not in ("chars", "words"):
        raise ValueError(f"length_penalty: unit must be 'chars' or 'words', got {unit!r}")


@register("length_penalty", check=_check_length)
def length_penalty(
    prompt: str,
    completion: str,
    ground_truth: str | None,
    metadata: Mapping[str, Any],
    *,
    target: int,
    window: int | None = None,
    unit: str = "chars",
) -> RewardResult:
    """0.0 up to `target` length, then falls linearly to -1.0 at `target + window` and stays there.

    `window` defaults to `target` (so twice the target length costs the full penalty).
    Scale it with a weight in `weighted`.
    """
    _check_length(target=target, window=window, unit=unit)
    n = len(completion) if unit == "chars" else len(completion.split())
    span = window if window is not None else max(target, 1)
    over = max(0, n - target)
    return RewardResult(-min(1.0, over / span), {"length": n})


def _check_format(
    *, pattern: str | None = None, think_tag: str = "think", answer_tag: str | None = None
) -> None:
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"format: invalid pattern {pattern!r}: {exc}") from exc
    for name, tag in (("think_tag", think_tag), ("answer_tag", answer_tag)):
        if tag is not None and not re.fullmatch(r"[A-Za-z][\w-]*", tag):
            raise ValueError(f"format: {name} must be a tag name like 'think', got {tag!r}")


def _format_regex(think_tag: str, answer_tag: str | None) -> str:
    think = rf"\s*<{think_tag}>\s*\S.*?</{think_tag}>\s*"
    if answer_tag:
        return think + rf"<{answer_tag}>\s*\S.*?</{answer_tag}>\s*"
    return think + r"\S.*"


@register("format", check=_check_format)
def format_reward(
    prompt: str,
    completion: str,
    ground_truth: str | None,
    metadata: Mapping[str, Any],
    *,
    pattern: str | None = None,
    think_tag: str = "think",
    answer_tag: str | None = None,
) -> RewardResult:
    """1.0 when the whole completion is a non-empty `<think>...</think>` block followed by a
    non-empty answer (wrapped in `<answer_tag>...</answer_tag>` when set). A custom `pattern` must
    match the whole completion (re.fullmatch, DOTALL)."""
    regex = pattern if pattern is not None else _format_regex(think_tag, answer_tag)
    matched = re.fullmatch(regex, completion, flags=re.DOTALL) is not None
    return RewardResult(float(matched), {})
