"""Math answer extraction and numeric comparison.

Extraction order: the last `\\boxed{...}`, else the last GSM8K `#### answer`, else the *last*
number in the text. The last, not the first: small models say "The answer is 11." after restating
the question's numbers, and first-number extraction scores 0 on addition
(docs/architecture.md#measured-facts).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lorarl.rewards.registry import RewardResult, register

__all__ = [
    "Extraction",
    "answers_equal",
    "extract_answer",
    "gsm8k",
    "gsm8k_lenient",
    "gsm8k_strict_answer",
    "math_answer",
    "parse_number",
]

REL_TOL = Fraction(1, 10**6)

_INT = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # 1,234 only with well-formed thousands groups
_DEC = rf"(?:{_INT}(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_SIGN = r"(?:(?<![\w)\]}])[-−])?"  # a minus only when it is not a subtraction ("10-3")
_FRAC_ARG = r"\{\s*-?[\d.,]+\s*\}|\d"
_NUMBER_RE = re.compile(
    rf"(?P<latex>{_SIGN}\\[dt]?frac\s*(?:{_FRAC_ARG})\s*(?:{_FRAC_ARG}))"
    rf"|(?P<plain>{_SIGN}{_DEC}(?:\s*/\s*{_DEC})?)"
)
_LATEX_FRAC_RE = re.compile(r"^([-−]?)\\[dt]?frac\s*(?:\{([^{}]*)\}|(\d))\s*(?:\{([^{}]*)\}|(\d))$")
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
_WRAPPERS_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")


@dataclass(frozen=True)
class Extraction:
    text: str
    method: str  # "boxed" | "gsm8k" | "last_number"


def find_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), honouring nested braces."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
        # unbalanced: try an earlier one
    return None


def last_number(text: str) -> str | None:
    matches = list(_NUMBER_RE.finditer(text))
    return matches[-1].group(0) if matches else None


def extract_answer(text: str) -> Extraction | None:
    boxed = find_boxed(text)
    if boxed is not None:
        return Extraction(boxed, "boxed")
    gsm = _GSM8K_RE.findall(text)
    if gsm:
        first = _NUMBER_RE.search(gsm[-1])
        return Extraction(first.group(0) if first else gsm[-1].strip(), "gsm8k")
    number = last_number(text)
    return Extraction(number, "last_number") if number is not None else None


def parse_number(text: str) -> Fraction | None:
    """Exact value of '1,234', '-3', '2.5', '1e-3', '1/2', '\\frac{1}{2}', '$18', '50%' (-> 50)."""
    s = _WRAPPERS_RE.sub(r"\1", text).strip().strip("$").strip()
    s = s.rstrip(".").replace("−", "-").replace("\\!", "").replace("\\,", "")
    s = s.removesuffix("\\%").removesuffix("%").strip()
    latex = _LATEX_FRAC_RE.match(s)
    if latex:
        sign, num_b, num_d, den_b, den_d = latex.groups()
        num, den = _plain(num_b or num_d), _plain(den_b or den_d)
        if num is None or den is None or den == 0:
            return None
        value = num / den
        return -value if sign else value
    if "/" in s:
        num_s, _, den_s = s.partition("/")
        num, den = _plain(num_s), _plain(den_s)
        if num is None or den is None or den == 0:
            return None
        return num / den
    return _plain(s)


def _plain(s: str) -> Fraction | None:
    s = s.strip()
    if not re.fullmatch(rf"-?{_DEC}", s):
        return None
    return Fraction(s.replace(",", ""))


def answers_equal(predicted: str, truth: str) -> bool:
    """Numerically within 1e-6 relative when the truth is a number, else normalized text."""
    b = parse_number(truth)
    if b is None:
        return _norm_text(predicted) == _norm_text(truth)
    a = parse_number(predicted)
    if a is None:  # e.g. "x = 5" or "42 apples" inside a box: use its last number
        inner = last_number(predicted)
        a = parse_number(inner) if inner is not None else None
    if a is None:
        return False
    return a == b or abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def _norm_text(s: str) -> str:
    s = _WRAPPERS_RE.sub(r"\1", s)
    return re.sub(r"\s+|\$", "", s).rstrip(".").casefold()


def _truth_answer(truth: str) -> str:
    """A bare truth is used as is; a GSM8K solution ("... #### 72") is extracted like output."""
    if parse_number(truth) is not None:
        return truth
    extracted = extract_answer(truth) if ("####" in truth or "\\boxed" in truth) else None
    return extracted.text if extracted else truth.strip()


@register("math_answer")
def math_answer(
    prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
) -> RewardResult:
    """1.0 when the extracted answer equals the truth (numerically when both are numbers)."""
    if ground_truth is None:
        raise ValueError("math_answer needs a ground truth (set the dataset's answer key)")
    truth = _truth_answer(str(ground_truth))
    extracted = extract_answer(completion)
    if extracted is None:
        return RewardResult(0.0, {"extracted": None, "truth": truth, "method": None})
    ok = answers_equal(extracted.text, truth)
    return RewardResult(
        1.0 if ok else 0.0,
        {"extracted": extracted.text, "truth": truth, "method": extracted.method},
    )


# GSM8K, strict as verl's `verl/utils/reward_score/gsm8k.py` (`compute_score`, method="strict"):
# only the number written after the last "#### " in the reply's last 300 characters counts, commas
# and dollar signs dropped, compared as text with the truth. No "####", no reward: the reward also
# checks that the model keeps the answer format the prompt asks for.
_GSM8K_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_TAIL_CHARS = 300


def gsm8k_strict_answer(text: str) -> str | None:
    """verl's strict extraction: the last `#### N` in the last 300 characters, or None."""
    found = _GSM8K_STRICT_RE.findall(text[-_GSM8K_TAIL_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def _gsm8k_truth(truth: str) -> str:
    """The truth's final answer: a full GSM8K solution ("... #### 1,234") gives "1234"."""
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    return truth.strip().replace(",", "").replace("$", "")


@register("gsm8k")
def gsm8k(
    prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
) -> RewardResult:
    """1.0 when `#### N` ends the reply with N the truth as text (verl's strict GSM8K scorer).

    "The answer is 72." scores 0, and so do "#### 72.0" and a `\\boxed{72}`: use `gsm8k_lenient`
    for the last number of a reply in any form, compared numerically."""
    if ground_truth is None:
        raise ValueError("gsm8k needs a ground truth (set the dataset's answer key)")
    truth = _gsm8k_truth(str(ground_truth))
    got = gsm8k_strict_answer(completion)
    return RewardResult(
        float(got is not None and got == truth),
        {"extracted": got, "truth": truth, "method": "gsm8k" if got is not None else None},
    )


@register("gsm8k_lenient")
def gsm8k_lenient(
    prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
) -> RewardResult:
    """`math_answer` under a GSM8K name: the last `\\boxed{}`, else the last `####`, else the last
    number anywhere, compared numerically ("72.0", "$72", "1,234" all count)."""
    if ground_truth is None:
        raise ValueError("gsm8k_lenient needs a ground truth (set the dataset's answer key)")
    return math_answer(prompt, completion, ground_truth, metadata)
