"""Agent episodes (`spec.agent`): your agent function calls the policy through an
OpenAI-compatible endpoint, every call is recorded token-exactly, and each call becomes a
training sample with the episode's reward (docs/environments.md, "Agents through an
OpenAI-compatible endpoint").

    async def run(client, sample, ctx) -> float | {"reward": float, **metrics}

`client` is an `openai.AsyncOpenAI` pointed at the endpoint with the episode's own key (a
framework can use `ctx.base_url` and `ctx.api_key` instead); `sample` is the data row
(`AgentSample`); `ctx` says which episode this is (`AgentContext`). An episode that raises, times
out, makes no model call or returns something else fails: its group is dropped for the step and
counted, the step goes on. A failure of the engines themselves fails the step, as it would for
any other rollout.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.endpoint import AgentEndpoint, EpisodeCalls, serve
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.types import Sample, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentSample:
    """The data row an episode works on: `prompt` as the data has it (a string or chat
    messages), `messages` as chat messages (data.systemPrompt is in both), the reference answer."""

    prompt: Any
    messages: list[dict[str, Any]]
    answer: Any
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class AgentContext:
    base_url: str  # the endpoint (…/v1), for a framework configured by URL
    api_key: str  # this episode's key
    model: str  # any name: the endpoint serves the step's policy whatever the request says
    episode: int  # index in the step's episodes
    group: int  # which prompt of the step
    seed: int  # reproducible randomness for the agent's own choices
    max_tokens: int  # data.maxResponseTokens: the most one call generates


@dataclass
class AgentEpisode:
    calls: list[Sample]
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


class AgentFailed(Exception):
    """An episode that did not produce a usable trajectory (its group is dropped)."""


@dataclass
class AgentRunner:
    client: RolloutClient
    tokenizer: Any
    agent: Callable[..., Any]
    max_concurrency: int
    timeout_s: float
    max_turns: int  # agent.maxCalls: each episode's block of sampling seeds
    max_prompt_tokens: int
    max_response_tokens: int
    chat_template_kwargs: Mapping[str, Any] | None = None
    merge: bool = False  # agent.trajectory: merged
    failures: list[str] = field(default_factory=list)  # of the last run, one line each

    def run(
        self,
        items: Sequence[PromptItem],
        n: int,
        params: SamplingParams,
        *,
        model: str,
        version: int,
        seed: int,
    ) -> list[list[AgentEpisode]]:
        """`n` episodes per item; a group with a failed episode comes back empty."""
        return asyncio.run(self.arun(items, n, params, model=model, version=version, seed=seed))

    async def arun(self, items, n, params, *, model, version, seed) -> list[list[AgentEpisode]]:
        import openai

        self.failures = []
        endpoint = AgentEndpoint(
            self.client, self.tokenizer, max_prompt_tokens=self.max_prompt_tokens,
            max_response_tokens=self.max_response_tokens,
            chat_template_kwargs=self.chat_template_kwargs,
        )  # fmt: skip
        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(item: PromptItem, group: int, k: int) -> AgentEpisode | None:
            seed_base = None if params.seed is None else params.seed + k * self.max_turns
            calls = EpisodeCalls(params, model, version, self.max_turns, seed_base)
            async with gate:
                key = endpoint.open(calls)
                agent_client = openai.AsyncOpenAI(
                    base_url=server.base_url, api_key=key, max_retries=0, timeout=self.timeout_s
                )
                ctx = AgentContext(
                    server.base_url, key, endpoint.served_name, k, group, seed + k,
                    self.max_response_tokens,
                )  # fmt: skip
                try:
                    result = await asyncio.wait_for(
                        self.agent(agent_client, self._sample(item), ctx), self.timeout_s
                    )
                    episode = _episode(calls.calls, result)
                    if self.merge and (merged := merge_calls(episode.calls)) is not None:
                        episode.calls = [merged]
                    return episode
                except Exception as exc:  # a failed episode is dropped and counted, not fatal
                    why = "timed out" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
                    self.failures.append(f"episode {k}: {why}"[:300])
                    return None
                finally:
                    endpoint.close(key)
                    await agent_client.close()

        async with self.client, serve(endpoint.app) as server:
            flat = await asyncio.gather(
                *(one(item, i, i * n + j) for i, item in enumerate(items) for j in range(n))
            )
        if endpoint.engine_error is not None:
            raise endpoint.engine_error
        if self.failures:
            log.warning(
                "%d of %d agent episodes failed (their groups are not trained this step); "
                "first: %s", len(self.failures), len(flat), self.failures[0],
            )  # fmt: skip
        groups = [flat[i * n : (i + 1) * n] for i in range(len(items))]
        kept = [[e for e in g if e is not None] for g in groups]
        return [k if len(k) == len(g) else [] for k, g in zip(kept, groups, strict=True)]

    def _sample(self, item: PromptItem) -> AgentSample:
        if isinstance(item.prompt, str):
            messages = [{"role": "user", "content": item.prompt}]
        else:
            messages = [dict(m) for m in item.prompt]
        return AgentSample(item.prompt, messages, item.answer, dict(item.metadata))


def _episode(calls: list[Sample], result: Any) -> AgentEpisode:
    if not calls:
        raise AgentFailed("the agent made no model call")
    metrics: dict[str, float] = {}
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise AgentFailed(f"the agent returned a dict without 'reward': {result!r:.120}")
        for name, value in result.items():
            if name != "reward" and _number(value):
                metrics[str(name)] = float(value)
        result = result["reward"]
    if not _number(result):
        raise AgentFailed(f"the agent returned {result!r:.80}, not a finite reward")
    return AgentEpisode(list(calls), float(result), metrics)


def merge_calls(calls: Sequence[Sample]) -> Sample | None:
    """An episode's calls as one sample when they extend one conversation: each call's prompt ids
    start with the previous call's prompt + completion ids, token for token. What lies between
    two replies (tool results, the next user turn, the template's markup) joins the completion
    with loss mask 0 and logprob 0; the model's own tokens keep their mask 1 and the engine's
    logprobs. None when the calls do not extend each other (train them per call)."""
    if len(calls) <= 1:
        return calls[0] if calls else None
    first = calls[0]
    ids, logprobs = list(first.completion_ids), list(first.logprobs)
    mask = list(first.loss_mask or [1] * len(ids))
    for call in calls[1:]:
        so_far = [*first.prompt_ids, *ids]
        if call.prompt_ids[: len(so_far)] != so_far:
            return None
        inserted = call.prompt_ids[len(so_far) :]
        ids += inserted + list(call.completion_ids)
        logprobs += [0.0] * len(inserted) + list(call.logprobs)
        mask += [0] * len(inserted) + list(call.loss_mask or [1] * len(call.completion_ids))
    last = calls[-1]
    return Sample(
        prompt_ids=list(first.prompt_ids),
        completion_ids=ids,
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        weight_version=min(c.weight_version for c in calls),
        endpoint=last.endpoint,
        text=last.text,
        loss_mask=tuple(mask),
    )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def build_agent_runner(job: LoRARLJob, tokenizer: Any, client: RolloutClient) -> AgentRunner | None:
    """The job's agent runner (None without spec.agent); imports the agent now, so a bad
    entrypoint fails the job at start."""
    spec = job.spec
    agent = spec.agent
    if agent is None:
        return None
    from lorarl.entrypoints import import_entrypoint

    try:
        import openai  # noqa: F401
    except ImportError as exc:
        raise ConfigError("spec.agent needs the openai package in the trainer's image") from exc
    try:
        fn = import_entrypoint(agent.entrypoint, "spec.agent", want="an async function")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"spec.agent {agent.entrypoint!r} must be an async function "
            "(async def run(client, sample, ctx))"
        )
    return AgentRunner(
        client=client,
        tokenizer=tokenizer,
        agent=fn,
        max_concurrency=agent.max_concurrency,
        timeout_s=agent.timeout_seconds,
        max_turns=agent.max_calls,
        max_prompt_tokens=spec.data.max_prompt_tokens,
        max_response_tokens=spec.data.max_response_tokens,
        chat_template_kwargs=spec.data.chat_template_kwargs,
        merge=agent.trajectory == "merged",
    )
