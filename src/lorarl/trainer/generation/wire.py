"""Request builders and response parsers for the two rollout engines' HTTP APIs.

One small pure function per direction per engine, so contract tests can pin each payload against
the engine's own request model, and the client never touches JSON field names itself.

vLLM (OpenAI-compatible server) `POST /v1/completions`:
  a list of ints as `prompt` is one tokenized prompt; `n` samples come back as `choices` with
  `index` 0..n-1; `logprobs: 0` returns the sampled token's logprob only; with
  `return_tokens_as_token_ids` every entry of `logprobs.tokens` is `"token_id:<id>"`, which is the
  only way to get exact ids back (text round-trips are lossy). lorarl starts vLLM with
  `--logprobs-mode processed_logprobs`: logprobs of the distribution sampled from (after
  temperature, top-k, top-p, min-p and penalties); vLLM's default would be the raw model
  distribution. A `stop` string is cut from `text` (`include_stop_str_in_output: false`) while
  the tokens that formed it stay in the returned ids and logprobs.
  The response's `model` echoes the served name; in adapter mode that is `<name>-v<N>`.
SGLang (0.5.x) `POST /generate`:
  `input_ids` + `sampling_params` (incl. `n`); with `n > 1` the answer is a list of n objects, with
  `n == 1` a single object. `meta_info.output_token_logprobs` holds `[logprob, token_id, text|None]`
  per output token, after temperature (SGLang's default; `SGLANG_RETURN_ORIGINAL_LOGPROB` is pinned
  off in the engine's env); `meta_info.finish_reason` is `{"type": "stop"|"length"|"abort", ...}`;
  `meta_info.weight_version` is the engine's string version label (`"default"` until set).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from lorarl.trainer.generation.types import FinishReason, Sample, SamplingParams, WireFormatError

_TOKEN_ID_RE = re.compile(r"^token_id:(\d+)$")
_VERSIONED_NAME_RE = re.compile(r"-v(\d+)$")
_VERSION_LABEL_RE = re.compile(r"^v?(\d+)$")


def version_from_model_name(name: object) -> int | None:
    """`policy-v12` -> 12: the version encoded in a versioned adapter name, else None."""
    if not isinstance(name, str):
        return None
    m = _VERSIONED_NAME_RE.search(name)
    return int(m.group(1)) if m else None


def version_from_label(label: object) -> int | None:
    """SGLang's `weight_version` label (`"7"`, `"v7"`) -> 7; `"default"` or absent -> None."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label if label >= 0 else None
    if isinstance(label, str):
        m = _VERSION_LABEL_RE.match(label.strip())
        return int(m.group(1)) if m else None
    return None


# --------------------------------------------------------------------------------------- vLLM


def build_vllm_completion_request(
    prompt_ids: Sequence[int], n: int, params: SamplingParams, *, model: str
) -> dict[str, Any]:
    """Body of `POST /v1/completions` for n samples of one tokenized prompt."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": True,
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": False,
    }
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    body.update(_optional_fields(params))
    return body


def parse_vllm_completion_response(
    body: object,
    *,
    prompt_ids: Sequence[int],
    n: int,
    endpoint: str,
    expected_version: int,
) -> list[Sample]:
    """`/v1/completions` JSON -> n Samples in choice-index order."""
    if not isinstance(body, Mapping):
        raise WireFormatError(f"vLLM response from {endpoint} is not a JSON object")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != n:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise WireFormatError(f"vLLM response from {endpoint}: expected {n} choices, got {got}")
    reported = version_from_model_name(body.get("model"))
    version = expected_version if reported is None else reported
    by_index: dict[int, Sample] = {}
    for pos, choice in enumerate(choices):
        where = f"vLLM response from {endpoint}: choices[{pos}]"
        if not isinstance(choice, Mapping):
            raise WireFormatError(f"{where} is not an object")
        index = choice.get("index", pos)
        if not isinstance(index, int) or not 0 <= index < n or index in by_index:
            raise WireFormatError(f"{where}.index={index!r} is not a distinct index in [0, {n})")
        ids, logprobs = _vllm_tokens_and_logprobs(choice.get("logprobs"), where)
        token_ids = choice.get("token_ids")  # present when the request set return_token_ids
        if token_ids is not None and list(token_ids) != ids:
            raise WireFormatError(f"{where}.token_ids disagree with logprobs.tokens")
        by_index[index] = Sample(
            prompt_ids=list(prompt_ids),
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=_finish_reason(choice.get("finish_reason"), f"{where}.finish_reason"),
            weight_version=version,
            endpoint=endpoint,
            text=str(choice.get("text") or ""),
        )
    return [by_index[i] for i in range(n)]


def _vllm_tokens_and_logprobs(lp: object, where: str) -> tuple[list[int], list[float]]:
    if not isinstance(lp, Mapping):
        raise WireFormatError(f"{where}.logprobs is missing (request must set logprobs=0)")
    tokens, values = lp.get("tokens"), lp.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise WireFormatError(
            f"{where}.logprobs.tokens and .token_logprobs must be lists of equal length"
        )
    ids: list[int] = []
    for i, tok in enumerate(tokens):
        m = _TOKEN_ID_RE.match(tok) if isinstance(tok, str) else None
        if m is None:
            raise WireFormatError(
                f"{where}.logprobs.tokens[{i}]={tok!r} is not 'token_id:<id>' "
                "(request must set return_tokens_as_token_ids=true)"
            )
        ids.append(int(m.group(1)))
    return ids, [_logprob(v, f"{where}.logprobs.token_logprobs[{i}]") for i, v in enumerate(values)]


# ------------------------------------------------------------------------------------- SGLang


def build_sglang_generate_request(
    prompt_ids: Sequence[int],
    n: int,
    params: SamplingParams,
    *,
    lora_name: str | None = None,
) -> dict[str, Any]:
    """Body of `POST /generate` for n samples of one tokenized prompt (SGLang 0.5.x)."""
    sampling: dict[str, Any] = {
        "max_new_tokens": params.max_tokens,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": -1 if params.top_k is None else params.top_k,  # SGLang spells "disabled" -1
        "n": n,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": True,
    }
    if params.seed is not None:
        sampling["sampling_seed"] = params.seed
    sampling.update(_optional_fields(params))  # SGLang's own names; no_stop_trim stays False
    body: dict[str, Any] = {
        "input_ids": [int(t) for t in prompt_ids],
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only: no prompt logprobs
        "stream": False,
    }
    if lora_name is not None:
        body["lora_path"] = lora_name
    return body


def parse_sglang_generate_response(
    body: object,
    *,
    prompt_ids: Sequence[int],
    n: int,
    endpoint: str,
    expected_version: int,
    lora_name: str | None = None,
) -> list[Sample]:
    """`/generate` JSON (one object, or a list of n) -> n Samples in order."""
    items = [body] if isinstance(body, Mapping) else body
    if not isinstance(items, list) or len(items) != n:
        got = len(items) if isinstance(items, list) else type(body).__name__
        raise WireFormatError(f"SGLang response from {endpoint}: expected {n} outputs, got {got}")
    fallback = version_from_model_name(lora_name)
    fallback = expected_version if fallback is None else fallback
    samples = []
    for i, item in enumerate(items):
        where = f"SGLang response from {endpoint}: [{i}]"
        if not isinstance(item, Mapping) or not isinstance(item.get("meta_info"), Mapping):
            raise WireFormatError(f"{where}.meta_info is missing")
        meta = item["meta_info"]
        ids, logprobs = _sglang_tokens_and_logprobs(meta.get("output_token_logprobs"), where)
        output_ids = item.get("output_ids")
        if output_ids is not None and list(output_ids) != ids:
            raise WireFormatError(
                f"{where}.output_ids ({len(output_ids)} tokens) disagree with "
                f"meta_info.output_token_logprobs ({len(ids)} tokens)"
            )
        reason = meta.get("finish_reason")
        reason_type = reason.get("type") if isinstance(reason, Mapping) else reason
        reported = version_from_label(meta.get("weight_version"))
        samples.append(
            Sample(
                prompt_ids=list(prompt_ids),
                completion_ids=ids,
                logprobs=logprobs,
                finish_reason=_finish_reason(reason_type, f"{where}.meta_info.finish_reason"),
                weight_version=fallback if reported is None else reported,
                endpoint=endpoint,
                text=str(item.get("text") or ""),
            )
        )
    return samples


def _sglang_tokens_and_logprobs(entries: object, where: str) -> tuple[list[int], list[float]]:
    if not isinstance(entries, list):
        raise WireFormatError(
            f"{where}.meta_info.output_token_logprobs is missing (request must set return_logprob)"
        )
    ids: list[int] = []
    values: list[float] = []
    for j, entry in enumerate(entries):
        field = f"{where}.meta_info.output_token_logprobs[{j}]"
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise WireFormatError(f"{field} must be [logprob, token_id, text]")
        tok = entry[1]
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise WireFormatError(f"{field}: token id {tok!r} is not a non-negative integer")
        ids.append(tok)
        values.append(_logprob(entry[0], field))
    return ids, values


# ------------------------------------------------------------------------------------- shared


def _optional_fields(params: SamplingParams) -> dict[str, Any]:
    """Stop strings, min-p and repetition penalty: the same names in both engines' APIs, sent
    only when set so a default request stays the engine's default."""
    out: dict[str, Any] = {}
    if params.stop:
        out["stop"] = list(params.stop)
    if params.min_p:
        out["min_p"] = float(params.min_p)
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = float(params.repetition_penalty)
    return out


def _finish_reason(value: object, field: str) -> FinishReason:
    if value in ("stop", "length"):
        return value
    if value == "abort":
        raise WireFormatError(f"{field}: the engine aborted the request")
    raise WireFormatError(f"{field}={value!r}, expected 'stop' or 'length'")


def _logprob(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WireFormatError(f"{field}={value!r} is not a number")
    value = float(value)
    if math.isnan(value) or value > 1e-6:
        raise WireFormatError(f"{field}={value!r} is not a log-probability (must be <= 0)")
    return min(value, 0.0)
