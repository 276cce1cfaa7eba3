"""A reward file written the way verl users write theirs (verl's `custom_reward_function.path`
and `name`), used by lorarl as it is:

    reward:
      entrypoint: examples/rewards/gsm8k_verl.py:compute_score   # path/to/file.py:function
      params: {method: flexible}                                  # keyword arguments, optional

GSM8K scoring in verl's manner: the number after the last "####" (strict) or the last number in
the reply (flexible), commas and dollar signs dropped, compared as text with the ground truth.
The dict it returns is verl's: `score` is the reward; `acc` and `formatted` (numbers) become the
step record's `rewardMetrics`; `pred` (text) is kept with the result but not averaged.
"""

import re

_AFTER_HASHES = re.compile(r"#### (-?[0-9.,$]+)")
_NUMBER = re.compile(r"-?[0-9][0-9.,$]*")
_TAIL_CHARS = 300  # the answer is at the end; long replies are not scanned whole


def extract_answer(solution_str, method="strict"):
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _AFTER_HASHES.findall(tail)
    elif method == "flexible":
        found = _NUMBER.findall(tail)
    else:
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if not found:
        return None
    answer = found[-1].replace(",", "").replace("$", "").rstrip(".")
    return answer or None


def compute_score(
    data_source, solution_str, ground_truth, extra_info=None, method="strict", format_score=0.0
):
    answer = extract_answer(solution_str, method)
    correct = answer is not None and answer == str(ground_truth).replace(",", "")
    if correct:
        score = 1.0
    elif answer is not None:  # an answer in the right form, but wrong
        score = format_score
    else:
        score = 0.0
    return {"score": score, "acc": correct, "formatted": answer is not None, "pred": answer or ""}
