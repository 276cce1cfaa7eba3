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
    """What an episode trains on: `calls` (its samples, after merging and role exclusion) and
    the reward each is trained toward (`returns`, one per sample); `reward` is the episode's."""

    calls: list[Sample]
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    returns: list[float] = field(default_factory=list)
    n_calls: int = 0  # model calls the agent made, of every role
    generated: int = 0  # tokens the engines generated for them

    def __post_init__(self) -> None:
        if not self.returns:
            self.returns = [self.reward] * len(self.calls)
        self.n_calls = self.n_calls or len(self.calls)
        self.generated = self.generated or sum(len(c.completion_ids) for c in self.calls)


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
    exclude_roles: frozenset[str] = frozenset()  # agent.excludeRoles: not trained on
    call_rewards: bool = False  # ppo: an agent may return call_rewards
    retries: int = 0  # agent.retries: tries of a failed episode after its first
    failures: list[str] = field(default_factory=list)  # of the last run, one line each
    retried: int = 0  # of the last run: episode tries that failed and were run again

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

        self.failures, self.retried = [], 0
        endpoint = AgentEndpoint(
            self.client, self.tokenizer, max_prompt_tokens=self.max_prompt_tokens,
            max_response_tokens=self.max_response_tokens,
            chat_template_kwargs=self.chat_template_kwargs,
        )  # fmt: skip
        gate = asyncio.Semaphore(self.max_concurrency)

        async def attempt(item: PromptItem, group: int, k: int) -> AgentEpisode:
            """One try of episode k: its own key and record; raises when it fails. A retry
            replays the same sampling seeds, so only a failure that was not the policy's doing
            (a tool server's hiccup, a timeout on a busy machine) can go differently."""
            seed_base = None if params.seed is None else params.seed + k * self.max_turns
            calls = EpisodeCalls(params, model, version, self.max_turns, seed_base)
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
                return self._episode(calls, result)
            finally:
                endpoint.close(key)
                await agent_client.close()

        async def one(item: PromptItem, group: int, k: int) -> AgentEpisode | None:
            async with gate:
                for tries in range(1, self.retries + 2):
                    try:
                        return await attempt(item, group, k)
                    except Exception as exc:  # a failed episode is dropped and counted
                        if endpoint.engine_error is not None:
                            return None  # the engines failed: the step fails, no retry
                        why = "timed out" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
                        if tries <= self.retries:
                            self.retried += 1
                            log.info("agent episode %d failed (%s); retrying", k, why[:200])
                            continue
                        after = f" (after {tries} tries)" if tries > 1 else ""
                        self.failures.append(f"episode {k}{after}: {why}"[:300])
            return None

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
        if self.retried:
            log.info("%d failed agent episode tries were run again", self.retried)
        groups = [flat[i * n : (i + 1) * n] for i in range(len(items))]
        kept = [[e for e in g if e is not None] for g in groups]
        return [k if len(k) == len(g) else [] for k, g in zip(kept, groups, strict=True)]

    def _sample(self, item: PromptItem) -> AgentSample:
        if isinstance(item.prompt, str):
            messages = [{"role": "user", "content": item.prompt}]
        else:
            messages = [dict(m) for m in item.prompt]
        return AgentSample(item.prompt, messages, item.answer, dict(item.metadata))

    def _episode(self, recorded: EpisodeCalls, result: Any) -> AgentEpisode:
        """The episode's training samples from its recorded calls and the agent's return value:
        excluded roles' calls dropped (perCall) or masked (merged); with ppo, `call_rewards`
        (one per recorded call, in request order) shape what each sample is trained toward."""
        calls, roles = list(recorded.calls), list(recorded.roles)
        if not calls:
            raise AgentFailed("the agent made no model call")
        reward, metrics, per_call = _result(result, len(calls), self.call_rewards)
        trained = [role not in self.exclude_roles for role in roles]
        generated = sum(len(c.completion_ids) for c in calls)
        if self.merge and (merged := merge_calls(calls, trained, per_call)) is not None:
            if not any(merged.loss_mask or [1]):
                raise AgentFailed("every call of the episode is by an excluded role")
            return AgentEpisode([merged], reward, metrics, [reward], len(calls), generated)
        # perCall: call k is trained toward what the episode earned from call k on
        earlier = [sum(per_call[:k]) for k in range(len(calls))] if per_call else [0.0] * len(calls)
        kept = [
            (c, reward - before) for c, t, before in zip(calls, trained, earlier, strict=True) if t
        ]
        if not kept:
            raise AgentFailed("every call of the episode is by an excluded role")
        return AgentEpisode(
            [c for c, _ in kept], reward, metrics, [r for _, r in kept], len(calls), generated
        )


def _result(
    result: Any, n_calls: int, call_rewards_ok: bool
) -> tuple[float, dict[str, float], list[float] | None]:
    """The agent's return value: its reward, metrics, and call rewards (if it gave them)."""
    metrics: dict[str, float] = {}
    per_call: list[float] | None = None
    if isinstance(result, Mapping):
        if "reward" not in result:
            raise AgentFailed(f"the agent returned a dict without 'reward': {result!r:.120}")
        for name, value in result.items():
            if name not in ("reward", "call_rewards") and _number(value):
                metrics[str(name)] = float(value)
        if "call_rewards" in result:
            per_call = _call_rewards(result["call_rewards"], n_calls, call_rewards_ok)
        result = result["reward"]
    if not _number(result):
        raise AgentFailed(f"the agent returned {result!r:.80}, not a finite reward")
    return float(result), metrics, per_call


def _call_rewards(value: Any, n_calls: int, ok: bool) -> list[float]:
    if not ok:
        raise AgentFailed(
            "call_rewards need algorithm.name: ppo (group algorithms give one advantage per "
            "episode): return the reward alone"
        )
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(map(_number, value)):
        raise AgentFailed(f"call_rewards must be a list of finite numbers, got {value!r:.80}")
    if len(value) != n_calls:
        raise AgentFailed(
            f"call_rewards has {len(value)} rewards for the episode's {n_calls} recorded calls "
            "(one per call that got an answer, in request order)"
        )
    return [float(v) for v in value]


def merge_calls(
    calls: Sequence[Sample],
    trained: Sequence[bool] | None = None,
    call_rewards: Sequence[float] | None = None,
) -> Sample | None:
    """An episode's calls as one sample when they extend one conversation: each call's prompt ids
    start with the previous call's prompt + completion ids, token for token. What lies between
    two replies (tool results, the next user turn, the template's markup) joins the completion
    with loss mask 0 and logprob 0; the model's own tokens keep their mask 1 (0 for a call whose
    `trained` is False: an excluded role's) and the engine's logprobs; a call's reward (ppo's
    `call_rewards`) sits on its last token. None when the calls do not extend each other (train
    them per call)."""
    if not calls:
        return None
    trained = list(trained) if trained is not None else [True] * len(calls)
    first = calls[0]
    ids: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    turns: list[tuple[int, float]] = []
    for k, call in enumerate(calls):
        so_far = [*first.prompt_ids, *ids]
        if call.prompt_ids[: len(so_far)] != so_far:
            return None
        inserted = call.prompt_ids[len(so_far) :]
        own = list(call.loss_mask or [1] * len(call.completion_ids))
        ids += inserted + list(call.completion_ids)
        logprobs += [0.0] * len(inserted) + list(call.logprobs)
        mask += [0] * len(inserted) + (own if trained[k] else [0] * len(own))
        if call_rewards is not None and call.completion_ids:
            turns.append((len(ids) - 1, float(call_rewards[k])))
    if len(calls) == 1 and trained[0] and call_rewards is None:
        return first
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
        turn_rewards=tuple(turns) if call_rewards is not None else None,
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
        exclude_roles=frozenset(agent.exclude_roles),
        call_rewards=spec.algorithm.name == "ppo",
        retries=agent.retries,
    )
