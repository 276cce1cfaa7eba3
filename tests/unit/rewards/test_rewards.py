"""Built-in rewards on tricky inputs, and the registry's resolution and error messages."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest

from lorarl.rewards import (
    RewardError,
    RewardResult,
    get_reward,
    list_rewards,
    register,
    registry,
    score_batch,
)
from lorarl.rewards.functions.builtin import extract_choice, normalize_text
from lorarl.rewards.functions.math_answer import extract_answer, find_boxed, parse_number


def score(spec, completion, truth=None, metadata=None, **params):
    return get_reward(spec, **params)("prompt", completion, truth, metadata or {})


# ---------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("  Paris. ", "paris"),
        ("New   York\n", "new york"),
        ("PARIS!", "Paris"),
        ("the end?!", "The End"),
    ],
)
def test_exact_match_normalizes(completion, truth):
    assert score("exact_match", completion, truth).score == 1.0


@pytest.mark.parametrize(
    ("completion", "truth"),
    [("Paris, France", "Paris"), ("Pa ris", "Paris"), ("", "Paris"), (".", "x")],
)
def test_exact_match_rejects_different_text(completion, truth):
    assert score("exact_match", completion, truth).score == 0.0


def test_normalize_text_keeps_inner_punctuation():
    assert normalize_text("  3.14  Is Pi. ") == "3.14 is pi"


def test_exact_match_without_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="ground truth"):
        score("exact_match", "x", None)


# ---------------------------------------------------------------- math_answer


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("The answer is 11.", "11"),  # trailing period
        ("37 + 45 = 82", "82"),  # the *last* number, not the first
        ("It costs 1,234 dollars", "1234"),  # thousands separator
        ("So x = -3", "-3"),  # negative
        ("(-3)", "-3"),
        ("10-3=7", "7"),  # a subtraction's minus is not a sign
        ("That is 2.50", "2.5"),
        ("half: 1/2", "0.5"),  # fraction vs decimal
        ("half: 0.5", "1/2"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{\\dfrac{3}{4}} hmm 7", "0.75"),  # boxed beats a later number
        ("\\boxed{\\frac{\\sqrt{4}}{2}} \\boxed{42}", "42"),  # last boxed
        ("first 5 then \\boxed{x = 12}", "12"),  # number inside a boxed equation
        ("\\boxed{\\text{12 apples}}", "12"),
        ("so 3 + 4\n#### 7", "7"),  # GSM8K marker
        ("#### $1,000", "1000"),
        ("The result is 3.0000001", "3"),  # within 1e-6 relative
        ("1e3", "1000"),
        ("It is \\frac{-1}{2}.", "-0.5"),
        ("answer: −4", "-4"),  # unicode minus
    ],
)
def test_math_answer_correct(completion, truth):
    result = score("math_answer", completion, truth)
    assert result.score == 1.0, result.info


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("37 + 45 = 82, not 81", "82"),  # last number is 81
        ("The result is 3.00001", "3"),  # 3.3e-6 relative: outside tolerance
        ("\\boxed{7} but maybe 8", "8"),
        ("no number here", "5"),
        ("1/0", "0"),
        ("1,2345", "12345"),  # malformed thousands: last number is 2345
        ("10-3", "-3"),  # a subtraction, not negative three
    ],
)
def test_math_answer_wrong(completion, truth):
    assert score("math_answer", completion, truth).score == 0.0


def test_math_answer_accepts_a_full_gsm8k_solution_as_truth():
    truth = "Natalia sold 48/2 = 24 clips in May.\nSo 48+24 = 72 in total.\n#### 72"
    assert score("math_answer", "She sold 72 clips.", truth).score == 1.0
    assert score("math_answer", "She sold 24 clips.", truth).score == 0.0


def test_math_answer_non_numeric_truth_compares_text():
    assert score("math_answer", "\\boxed{2x + 1}", "2x+1").score == 1.0
    assert score("math_answer", "\\boxed{3x + 1}", "2x+1").score == 0.0


def test_math_answer_reports_what_it_extracted():
    result = score("math_answer", "37 + 45 = 82.", "82")
    assert result.info == {"extracted": "82", "truth": "82", "method": "last_number"}
    assert score("math_answer", "nothing", "1").info["extracted"] is None


def test_find_boxed_honours_nested_braces():
    assert find_boxed("x \\boxed{\\frac{a}{b^{2}}} y") == "\\frac{a}{b^{2}}"
    assert find_boxed("unbalanced \\boxed{1 + {2}") is None


def test_extract_answer_order():
    assert extract_answer("#### 5 and \\boxed{6}").method == "boxed"
    assert extract_answer("3 #### 5 then 9").text == "5"
    assert extract_answer("abc") is None


@pytest.mark.parametrize(
    ("text", "num", "den"),
    [
        ("1,234", 1234, 1),
        ("-2.5", -5, 2),
        ("\\frac{3}{6}", 1, 2),
        ("\\frac12", 1, 2),
        ("$18", 18, 1),
        ("50%", 50, 1),
        ("7.", 7, 1),
        ("-3/4", -3, 4),
    ],
)
def test_parse_number_is_exact(text, num, den):
    value = parse_number(text)
    assert value is not None
    assert (value.numerator, value.denominator) == (num, den)


def test_parse_number_rejects_non_numbers():
    for text in ("abc", "1/0", "\\frac{1}{0}", "1,23", ""):
        assert parse_number(text) is None, text


# ---------------------------------------------------------------- multiple_choice


@pytest.mark.parametrize(
    ("completion", "letter"),
    [
        ("The answer is (B)", "B"),
        ("B.", "B"),
        ("**C**", "C"),
        ("Answer: D", "D"),
        ("I considered (A) and (C); the answer is E.", "E"),  # explicit answer wins
        ("A cat eats fish, so the correct option is (D).", "D"),  # prose 'A' is not a choice
        ("Options (A) and (B) are wrong.\nC", "C"),  # last marked choice
        ("the answer is a bit unclear, I pick (B)", "B"),  # lowercase 'a' is a word
        ("**Answer: (A)**", "A"),
    ],
)
def test_extract_choice(completion, letter):
    assert extract_choice(completion) == letter


def test_extract_choice_none_when_unmarked():
    assert extract_choice("A long answer without a choice") is None


def test_multiple_choice_scores_and_validates_truth():
    assert score("multiple_choice", "The answer is (B)", "B").score == 1.0
    assert score("multiple_choice", "The answer is (B)", "(b)").score == 1.0
    assert score("multiple_choice", "The answer is (B)", "C").score == 0.0
    assert score("multiple_choice", "Answer: F", "F", choices="ABCDEF").score == 1.0
    with pytest.raises(ValueError, match="not one of ABCDE"):
        score("multiple_choice", "B", "Z")


# ---------------------------------------------------------------- regex_match


def test_regex_search_vs_full():
    assert score("regex_match", "result: 42 units", pattern=r"\d+").score == 1.0
    assert score("regex_match", "result: 42 units", pattern=r"\d+", mode="full").score == 0.0
    assert score("regex_match", "  42\n", pattern=r"\d+", mode="full").score == 1.0
    assert score("regex_match", "ABC", pattern="abc", ignore_case=True).score == 1.0
    assert score("regex_match", "ABC", pattern="abc").score == 0.0


def test_regex_pattern_from_metadata():
    fn = get_reward("regex_match", mode="full")
    assert fn("p", "yes", None, {"pattern": "yes|no"}).score == 1.0
    assert fn("p", "maybe", None, {"pattern": "yes|no"}).score == 0.0
    with pytest.raises(ValueError, match="no pattern"):
        fn("p", "yes", None, {})
    with pytest.raises(ValueError, match=r"invalid metadata\['pattern'\]"):
        fn("p", "yes", None, {"pattern": "("})


def test_regex_bad_params_fail_at_bind_time():
    with pytest.raises(ValueError, match="invalid pattern"):
        get_reward("regex_match", pattern="(unclosed")
    with pytest.raises(ValueError, match="mode must be one of"):
        get_reward("regex_match", pattern="x", mode="fullmatch")


# ---------------------------------------------------------------- json_valid


def test_json_valid():
    assert score("json_valid", '{"a": 1}').score == 1.0
    assert score("json_valid", "[1, 2]").score == 1.0
    assert score("json_valid", "{'a': 1}").score == 0.0
    assert score("json_valid", '```json\n{"a": 1}\n```').score == 1.0
    assert score("json_valid", '```json\n{"a": 1}\n```', strip_code_fence=False).score == 0.0


def test_json_valid_required_keys():
    result = score("json_valid", '{"a": 1, "c": 2}', required_keys=["a", "b"])
    assert result.score == 0.0
    assert result.info["missing_keys"] == ["b"]
    assert score("json_valid", '{"a": 1, "b": null}', required_keys=["a", "b"]).score == 1.0
    assert score("json_valid", '["a", "b"]', required_keys=["a"]).score == 0.0
    with pytest.raises(ValueError, match="list of strings"):
        score("json_valid", "{}", required_keys="a")


# ---------------------------------------------------------------- length_penalty


def test_length_penalty_is_linear_past_target():
    fn = get_reward("length_penalty", target=10, window=20)
    assert fn("p", "x" * 10, None, {}).score == 0.0
    assert fn("p", "x" * 15, None, {}).score == pytest.approx(-0.25)  # 5 over of 20
    assert fn("p", "x" * 30, None, {}).score == pytest.approx(-1.0)
    assert fn("p", "x" * 100, None, {}).score == pytest.approx(-1.0)  # capped


def test_length_penalty_words_and_default_window():
    assert score("length_penalty", "a b c d e f", target=4, unit="words").score == pytest.approx(
        -0.5
    )  # 2 over, window defaults to target=4
    with pytest.raises(ValueError, match="target must be"):
        get_reward("length_penalty", target=-1)
    with pytest.raises(ValueError, match="unit must be"):
        get_reward("length_penalty", target=5, unit="tokens")
    with pytest.raises(ValueError, match="target"):
        get_reward("length_penalty")  # target is required


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("completion", "ok"),
    [
        ("<think>add them</think> 82", True),
        ("\n<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 82.", True),
        ("<think>add them</think>", False),  # no answer
        ("<think> </think> 82", False),  # empty thinking
        ("82 <think>late</think> 82", False),  # must start with thinking
        ("<think>unclosed 82", False),
    ],
)
def test_format_think_then_answer(completion, ok):
    assert score("format", completion).score == float(ok)


def test_format_answer_tag_and_custom_pattern():
    good = "<think>hm</think><answer>82</answer>"
    assert score("format", good, answer_tag="answer").score == 1.0
    assert score("format", "<think>hm</think> 82", answer_tag="answer").score == 0.0
    assert score("format", "Final: 12", pattern=r"Final: \d+").score == 1.0
    assert score("format", "Final: 12 ok", pattern=r"Final: \d+").score == 0.0
    with pytest.raises(ValueError, match="think_tag"):
        get_reward("format", think_tag="<think>")


# ---------------------------------------------------------------- weighted


def test_weighted_sums_weighted_scores():
    fn = get_reward(
        "weighted",
        components=[
            ("math_answer", 1.0),
            ("format", 0.5),
            {"name": "length_penalty", "weight": 0.2, "params": {"target": 20, "window": 10}},
        ],
    )
    completion = "<think>37+45</think> The answer is 82."  # 39 chars: 19 over -> -1.0
    result = fn("p", completion, "82", {})
    assert result.score == pytest.approx(1.0 + 0.5 - 0.2)
    assert result.info["components"] == {
        "math_answer": 1.0,
        "format": 1.0,
        "length_penalty": -1.0,
    }


def test_weighted_labels_duplicates_and_accepts_callables():
    def always_one(prompt, completion, truth, metadata):
        return 1

    fn = get_reward(
        "weighted",
        components=[
            ("regex_match", 1.0, {"pattern": "a"}),
            ("regex_match", 2.0, {"pattern": "b"}),
            (always_one, -0.5),
        ],
    )
    result = fn("p", "b", None, {})
    assert result.score == pytest.approx(0 * 1.0 + 1 * 2.0 - 0.5)
    assert set(result.info["components"]) == {"regex_match", "regex_match#2", "always_one"}


@pytest.mark.parametrize(
    ("components", "message"),
    [
        ([], "non-empty"),
        ([("math_answer",)], "component 0"),
        ([("math_answer", "1")], "weight must be a finite number"),
        ([("math_answer", math.nan)], "weight must be a finite number"),
        ([{"reward": "math_answer"}], "must have keys name"),
        ([("nope", 1.0)], "unknown reward 'nope'"),
        ([("regex_match", 1.0, {"pattern": "("})], "invalid pattern"),
    ],
)
def test_weighted_rejects_bad_components(components, message):
    with pytest.raises(ValueError, match=message):
        get_reward("weighted", components=components)


# ---------------------------------------------------------------- registry


def test_list_rewards_has_the_builtins():
    expected = {"exact_match", "math_answer", "multiple_choice", "regex_match", "json_valid"}
    expected |= {"length_penalty", "format", "weighted"}
    assert expected <= set(list_rewards())


def test_unknown_builtin_lists_known_names():
    with pytest.raises(ValueError, match=r"unknown reward 'exactmatch'.*exact_match.*math_answer"):
        get_reward("exactmatch")


def test_unknown_param_is_named():
    with pytest.raises(ValueError, match=r"'math_answer'.*\['tolerance'\]"):
        get_reward("math_answer", tolerance=0.1)
    with pytest.raises(ValueError, match="accepts: pattern, mode"):
        get_reward("regex_match", patern="x")


@pytest.fixture
def user_module(monkeypatch):
    module = types.ModuleType("user_rewards_for_test")

    def contains(prompt, completion, truth, metadata, *, word="yes"):
        return RewardResult(float(word in completion), {"word": word})

    module.contains = contains
    module.not_callable = 42
    module.wrong_arity = lambda completion: 1.0
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_module_function_spec(user_module):
    fn = get_reward("user_rewards_for_test:contains", word="ok")
    assert fn.name == "user_rewards_for_test:contains"
    assert fn("p", "it is ok", None, {}) == RewardResult(1.0, {"word": "ok"})
    assert fn("p", "it is yes", None, {}).score == 0.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("user_rewards_for_test:missing", "has no attribute 'missing'"),
        ("user_rewards_for_test:not_callable", "'not_callable' is a int, not callable"),
        ("user_rewards_for_test:wrong_arity", "invalid parameters"),
        ("user_rewards_for_test:", "expected 'module:function'"),
        ("", "non-empty string"),
    ],
)
def test_module_function_errors(user_module, spec, message):
    with pytest.raises(ValueError, match=message):
        get_reward(spec)


def test_register_custom_and_duplicate_names(monkeypatch):
    list_rewards()  # load the built-ins before isolating the registry
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register("test_only_constant")
    def constant(prompt, completion, truth, metadata, *, value=0.25):
        return value

    assert get_reward("test_only_constant", value=0.75)("p", "c", None, {}) == 0.75
    with pytest.raises(ValueError, match="already registered"):
        register("test_only_constant")(lambda *a: 0.0)
    with pytest.raises(ValueError, match="contain no ':'"):
        register("a:b")


def test_score_batch_normalizes_and_aligns():
    fn = get_reward("math_answer")
    results = score_batch(fn, ["p1", "p2"], ["it is 4", "it is 5"], ["4", "4"], [{}, {}])
    assert [r.score for r in results] == [1.0, 0.0]

    as_float = score_batch(lambda p, c, t, m: len(c), ["p"], ["abc"])
    assert as_float == [RewardResult(3.0, {})]
    assert isinstance(as_float[0].score, float)
    assert score_batch(lambda p, c, t, m: True, ["p"], ["c"])[0].score == 1.0


def test_score_batch_errors_name_the_reward_and_item():
    with pytest.raises(ValueError, match="equal lengths"):
        score_batch(get_reward("exact_match"), ["p"], ["a", "b"], ["a", "b"])
    with pytest.raises(RewardError, match=r"'exact_match' failed on item 1: ValueError"):
        score_batch(get_reward("exact_match"), ["p", "p"], ["a", "b"], ["a", None])
    assert score_batch(lambda p, c, t, m: np.float32(0.5), ["p"], ["c"])[0].score == 0.5
    with pytest.raises(RewardError, match="non-finite"):
        score_batch(lambda p, c, t, m: math.inf, ["p"], ["c"])
    with pytest.raises(RewardError, match="returned str"):
        score_batch(lambda p, c, t, m: "1.0", ["p"], ["c"])


# ---------------------------------------------------------------- gsm8k (strict) and gsm8k_lenient


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("3 + 4 = 7 apples.\n#### 7", "7"),
        ("#### 1,234", "1234"),
        ("#### 1234", "1,234"),  # the truth's commas are dropped too
        ("#### -3", "-3"),
        ("first try #### 5, no: #### 8", "8"),  # the last one counts
        ("Janet has 16 - 3 - 4 = 9 eggs.\n#### 18", "Janet sells ... = $18 per day.\n#### 18"),
    ],
)
def test_gsm8k_strict_scores_the_answer_after_hashes(completion, truth):
    assert score("gsm8k", completion, truth).score == 1.0


@pytest.mark.parametrize(
    ("completion", "truth"),
    [
        ("The answer is 7.", "7"),  # no "####": 0, as in verl (lenient gives 1)
        ("\\boxed{7}", "7"),
        ("####7", "7"),  # verl's pattern wants the space
        ("#### 7.0", "7"),  # compared as text, as verl does
        ("#### 7\n" + "x" * 400, "7"),  # only the last 300 characters are read
        ("#### 8", "7"),
    ],
)
def test_gsm8k_strict_refuses_what_verl_refuses(completion, truth):
    assert score("gsm8k", completion, truth).score == 0.0


@pytest.mark.parametrize(
    ("completion", "truth"),
    [("The answer is 7.", "7"), ("\\boxed{7}", "7"), ("#### 7.0", "7"), ("#### 1,234", "1234")],
)
def test_gsm8k_lenient_keeps_the_last_number_scoring(completion, truth):
    assert score("gsm8k_lenient", completion, truth).score == 1.0
    assert score("gsm8k_lenient", completion, truth) == score("math_answer", completion, truth)


def test_gsm8k_scorers_are_listed_and_need_a_truth():
    assert {"gsm8k", "gsm8k_lenient"} <= set(list_rewards())
    for name in ("gsm8k", "gsm8k_lenient"):
        with pytest.raises(ValueError, match="ground truth"):
            score(name, "#### 7", None)


def test_gsm8k_strict_agrees_with_the_verl_example_file():
    """examples/rewards/gsm8k_verl.py is verl's scorer as users copy it: same answers."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "examples" / "rewards" / "gsm8k_verl.py"
    spec = importlib.util.spec_from_file_location("_gsm8k_verl_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cases = ["#### 7", "The answer is 7.", "#### 1,234", "####7", "a\n#### -3", "#### 7.0"]
    for completion in cases:
        for truth in ("7", "1234", "-3"):
            want = module.compute_score("openai/gsm8k", completion, truth)["score"]
            assert score("gsm8k", completion, truth).score == want, (completion, truth)
