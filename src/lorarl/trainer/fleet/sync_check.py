"""The stale-policy guard: an engine proves it serves a weight version before it generates from it.

A sidecar's "applied" is its own word, and in merged mode the engine cannot name the weights it
holds (other systems shipped runs whose engines kept the initial policy while training looked
healthy). So trainer rank 0 asks each engine itself, not its sidecar: the logprobs of one fixed
probe sequence, teacher-forced, under the served model (adapter mode: the versioned adapter
name, which an engine that never loaded it answers with 404). The trainer computed the same
logprobs after the update that made the version; `judge` compares the two.

The tolerance is a noise bound: a bf16 engine and the trainer disagree by ~1e-2 per token on
identical weights, fp32 ones by ~1e-5. An update that moved the probe by less than that cannot be
seen, and samples from either version are then equally on-policy to the engine's precision; an
update that moved it by more must have reached the engine (it is closer to the new version than
to the one before), and an engine further than the tolerance from the version fails whatever the
history. Checked once per (replica incarnation, version), before the replica's first generation
at that version: one extra forward of `PROBE_TOKENS` tokens on the trainer per step, one tiny
request per engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from torch import nn

from lorarl.api.resource import LoRARLJob
from lorarl.engines import sglang, vllm
from lorarl.plan.engines import SERVED_MODEL_NAME
from lorarl.trainer.data.prompts import PromptDataset, encode_prompts
from lorarl.trainer.model.logprobs import sequence_logprobs

PROBE_TOKENS = 64
# Mean |engine - trainer| logprob per probe token allowed, by the engine's dtype (measured in
# bench/results/mismatch.json: bf16 vLLM vs the fp32 trainer ~3e-3..4e-2; fp32 vs fp32 ~1e-5).
DEFAULT_TOLERANCE = {"float32": 2e-3, "bfloat16": 0.1, "float16": 0.1}


class ProbeError(RuntimeError):
    """The engine did not answer the probe as an engine serving the version would."""


class StalePolicy(RuntimeError):
    """A replica still serves other weights than the trainer published after a re-sync."""


def probe_ids(prompt_ids: Sequence[int], answer_ids: Sequence[int] = ()) -> list[int]:
    """The run's probe: a training prompt and its reference answer, the text the policy is
    trained on (an update moves it most), cut to the last `PROBE_TOKENS` tokens."""
    ids = [int(t) for t in (*prompt_ids, *answer_ids)][-PROBE_TOKENS:]
    if len(ids) < 2:
        raise ValueError(f"a probe needs at least 2 tokens, got {len(ids)}")
    return ids


def job_probe_ids(
    job: LoRARLJob, sync_world_size: int, dataset: PromptDataset, tokenizer: Any, pad_id: int
) -> list[int] | None:
    """The guard's probe (every rank computes it: each takes part in its forward), None when
    the guard is off or there are no sidecars: the first training prompt and its reference
    answer, as the engines would tokenize them."""
    spec = job.spec
    if sync_world_size <= 1 or not spec.rollout.sync_check.enabled:
        return None
    item = dataset[0]
    prompt = encode_prompts(
        tokenizer, [item.prompt], spec.data.max_prompt_tokens, truncate=True,
        chat_template_kwargs=dataset.chat_template_kwargs,
    )[0]  # fmt: skip
    answer = item.answer if isinstance(item.answer, str) else ""
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    if len(prompt) + len(answer_ids) < 2:  # a one-token prompt, no answer: end it
        answer_ids = [*answer_ids, pad_id]
    return probe_ids(prompt, answer_ids)


@torch.no_grad()
def expected_logprobs(model: nn.Module, ids: Sequence[int], device: torch.device) -> list[float]:
    """log p(ids[t] | ids[<t]) for t >= 1 under `model` at temperature 1 (what an engine's prompt
    logprobs are). Collective under FSDP: every rank calls it with the same ids."""
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    ones = torch.ones_like(input_ids)
    scored = ones.clone()
    scored[:, 0] = 0
    lp, _ = sequence_logprobs(model, input_ids, ones, scored, micro_batch_size=1)
    return [float(x) for x in lp[0, 1:].cpu()]


def probe_request(
    engine: str, ids: Sequence[int], model: str, lora: str | None
) -> tuple[str, dict]:
    """The request that returns `ids`' prompt logprobs, one token generated (greedy)."""
    if engine == "vllm":
        return vllm.COMPLETIONS, {
            "model": model,
            "prompt": list(ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
    payload: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    if lora is not None:
        payload["lora_path"] = lora
    return sglang.GENERATE, payload


def parse_probe(engine: str, body: Any, ids: Sequence[int], model: str) -> list[float]:
    """Logprobs of ids[1:] from a probe response; ProbeError when it is not one."""
    try:
        if engine == "vllm":
            if body.get("model") != model:
                raise ProbeError(f"answered as model {body.get('model')!r}, asked {model!r}")
            entries = body["choices"][0]["prompt_logprobs"]
            values = [float(entries[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]
        else:
            meta = body["meta_info"] if isinstance(body, dict) else body[0]["meta_info"]
            entries = meta["input_token_logprobs"]
            if [int(e[1]) for e in entries] != list(ids):
                raise ProbeError("input_token_logprobs are not of the probe's tokens")
            values = [float(e[0]) for e in entries[1:]]
    except ProbeError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise ProbeError(f"not a prompt-logprob answer ({type(exc).__name__}: {exc})") from None
    if len(values) != len(ids) - 1:
        raise ProbeError(f"{len(values)} prompt logprobs for {len(ids) - 1} tokens")
    return values


@dataclass(frozen=True)
class Verdict:
    ok: bool
    gap: float  # mean |engine - trainer(version)| per probe token
    gap_previous: float | None = None  # the same against the version before
    moved: float | None = None  # mean |trainer(version) - trainer(version before)|
    reason: str = ""


def _mean_abs(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / max(len(a), 1)


def judge(
    observed: Sequence[float],
    expected: Sequence[float],
    previous: Sequence[float] | None,
    tolerance: float,
) -> Verdict:
    """Does an engine that answered `observed` serve the version the trainer scored `expected`
    (and `previous` one version earlier)? Pure; see the module docstring for the rule."""
    if len(observed) != len(expected) or not all(math.isfinite(x) for x in observed):
        return Verdict(False, math.inf, reason="the engine's probe logprobs are not finite")
    gap = _mean_abs(observed, expected)
    moved = gap_previous = None
    if previous is not None:
        moved, gap_previous = _mean_abs(expected, previous), _mean_abs(observed, previous)
    if gap > tolerance:
        return Verdict(False, gap, gap_previous, moved, (
            f"its probe logprobs are {gap:.3g} per token from the trainer's (tolerance "
            f"{tolerance:g})"
        ))  # fmt: skip
    if moved is not None and gap_previous is not None and moved > tolerance and gap_previous < gap:
        return Verdict(False, gap, gap_previous, moved, (
            f"it answers like the previous version ({gap_previous:.3g} per token from it, "
            f"{gap:.3g} from this one, which moved {moved:.3g})"
        ))  # fmt: skip
    return Verdict(True, gap, gap_previous, moved)


class SyncCheck:
    """Rank 0's side of the guard: the trainer's expected probe logprobs per version, and which
    replica incarnation has proven which version."""

    def __init__(
        self,
        http: httpx.Client,
        engine: str,
        mode: str,
        served_name: str,
        tolerance: float,
        api_key: str | None = None,
        timeout_s: float = 60.0,
    ):
        self.http, self.engine, self.mode = http, engine, mode
        self.served_name, self.tolerance, self.timeout_s = served_name, tolerance, timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.ids: list[int] = []
        self._expected: dict[int, list[float]] = {}  # the last two versions
        self._proven: dict[tuple[str, str], int] = {}  # (engine URL, incarnation) -> version
        self.seconds = 0.0  # spent probing since `take_seconds`
        self.worst_gap: float | None = None  # largest passing gap since `take_seconds`

    @classmethod
    def from_job(cls, job: LoRARLJob, http: httpx.Client, api_key: str | None) -> SyncCheck:
        """Rank 0's guard for the job (spec.rollout.syncCheck)."""
        rollout = job.spec.rollout
        return cls(
            http,
            rollout.engine,
            rollout.sync_mode,
            SERVED_MODEL_NAME,
            tolerance=rollout.sync_check.tolerance or DEFAULT_TOLERANCE[job.spec.model.dtype],
            api_key=api_key,
        )

    def expect(self, version: int, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """What the trainer computed for `version` (after the update that made it)."""
        if list(ids) != self.ids:
            self.ids, self._expected = list(ids), {}
        self._expected[version] = list(logprobs)
        for old in [v for v in self._expected if v < version - 1]:
            del self._expected[old]

    def proven(self, engine_url: str, incarnation: str, version: int) -> bool:
        return self._proven.get((engine_url, incarnation)) == version

    def forget(self, engine_url: str, incarnation: str) -> None:
        self._proven.pop((engine_url, incarnation), None)

    def check(self, engine_url: str, incarnation: str, version: int, adapter: str) -> Verdict:
        """Probe one engine at `version`; `adapter` is the served name in adapter mode."""
        expected = self._expected.get(version)
        if expected is None:
            raise KeyError(f"no expected probe logprobs for version {version}")
        model = adapter if self.mode == "adapter" else self.served_name
        lora = adapter if self.mode == "adapter" else None
        path, payload = probe_request(self.engine, self.ids, model, lora)
        start = time.perf_counter()
        try:
            reply = self.http.post(
                f"{engine_url}{path}", json=payload, headers=self._headers, timeout=self.timeout_s
            )
            if reply.status_code != 200:
                raise ProbeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
            observed = parse_probe(self.engine, reply.json(), self.ids, model)
        except (httpx.HTTPError, ValueError, ProbeError) as exc:
            return Verdict(False, math.inf, reason=f"the probe as {model!r} failed: {exc}")
        finally:
            self.seconds += time.perf_counter() - start
        verdict = judge(observed, expected, self._expected.get(version - 1), self.tolerance)
        if verdict.ok:
            self._proven[(engine_url, incarnation)] = version
            self.worst_gap = max(self.worst_gap or 0.0, verdict.gap)
        return verdict

    def take_seconds(self) -> tuple[float, float | None]:
        """Probe seconds and the worst passing gap since the last call (for the step record)."""
        out = (self.seconds, self.worst_gap)
        self.seconds, self.worst_gap = 0.0, None
        return out
