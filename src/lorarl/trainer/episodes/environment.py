"""Multi-turn episodes (`spec.environment`): the model and an environment take turns until the
environment says done, the turns run out, the token budget is spent or the time is up
(docs/environments.md).

The sequence is built from token ids only: the engine's sampled ids with its logprobs (loss mask
1), then the environment's messages rendered by `TurnTokens` (loss mask 0), and the whole sequence
so far is the next turn's prompt, so an engine with prefix caching reuses the episode's KV cache.
Every episode of a step runs concurrently with the others on the client's pooled connections.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from lorarl.api.resource import LoRARLJob
from lorarl.environments.base import EnvironmentContractError, EnvStep, EpisodeItem
from lorarl.trainer.data.prompts import DataError, PromptItem
from lorarl.trainer.episodes.turn_tokens import TurnTokens
from lorarl.trainer.errors import ConfigError
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.types import Sample, SamplingParams

log = logging.getLogger(__name__)

# Why an episode stopped: the environment said done, or it was cut.
ENDINGS = ("done", "tokens", "length", "turns", "timeout", "error")


class PromptTooLong(DataError):
    """An environment's first messages came out over data.maxPromptTokens at run time."""


@dataclass
class Episode:
    """One finished episode: a `Sample` whose completion holds every turn, plus what the
    environment reported."""

    sample: Sample
    env_reward: float
    last_reply: str  # the last assistant message's text (what finalReward scores)
    turns: int
    ending: str  # one of ENDINGS
    info: dict[str, float] = field(default_factory=dict)  # summed EnvStep.info counters
    env_calls: list[tuple[float, float]] = field(default_factory=list)  # (start, end), monotonic


@dataclass
class _Trace:
    """The episode so far; complete at every await, so a timeout keeps what was done."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    last_reply: str = ""
    ending: str = "turns"
    info: dict[str, float] = field(default_factory=dict)
    env_calls: list[tuple[float, float]] = field(default_factory=list)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)
    version: int | None = None
    endpoint: str = ""


@dataclass
class EpisodeRunner:
    client: RolloutClient
    turn_tokens: TurnTokens
    factory: Callable[[], Any]  # a new environment per episode
    max_turns: int
    max_total_tokens: int
    max_response_tokens: int
    timeout_s: float
    max_prompt_tokens: int | None = None  # the engines' context is sized for it

    def run(
        self,
        items: Sequence[PromptItem],
        n: int,
        params: SamplingParams,
        *,
        model: str,
        version: int,
        seed: int,
    ) -> list[list[Episode]]:
        """`n` episodes per item, in item order; `seed` makes the environments' randomness
        reproducible (episode k gets seed + k). The sampling's seeds are `params.seed` +
        k * max_turns + turn: one stream per (episode, turn), none shared within the call."""
        return asyncio.run(self.arun(items, n, params, model=model, version=version, seed=seed))

    async def arun(self, items, n, params, *, model, version, seed) -> list[list[Episode]]:
        # Plain environment methods run on this pool, not the loop's default executor: a call
        # that outlives its episode's timeout is abandoned here instead of holding up the step
        # (asyncio.run waits for every thread of its default executor).
        pool = ThreadPoolExecutor(min(32, max(1, len(items) * n)), "lorarl-env")
        try:
            async with self.client:
                flat = await asyncio.gather(
                    *(
                        self._fitting_episode(pool, item, params, model, version, seed, i * n + j)
                        for i, item in enumerate(items)
                        for j in range(n)
                    )
                )
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        groups = [flat[i * n : (i + 1) * n] for i in range(len(items))]
        # A group is trained whole or not at all: one episode over the budget skips its row.
        return [[] if any(e is None for e in g) else list(g) for g in groups]

    async def _fitting_episode(self, pool, item, params, model, version, seed, k):
        try:
            return await self._episode(pool, item, params, model, version, seed, k)
        except PromptTooLong as exc:
            log.warning("skipping a prompt this step: %s", exc)
            return None

    async def prompt_lengths(self, items: Sequence[PromptItem]) -> list[int]:
        """The first prompt's token count of each item as an episode would send it: the
        environment's `reset` messages (e.g. with `tool_calling`'s tool description), rendered.
        Uses seed 0; an environment whose first messages depend on the seed can still come out
        longer at run time (that episode's row is then skipped for the step)."""
        pool = ThreadPoolExecutor(min(32, max(1, len(items))), "lorarl-env")

        async def one(item: PromptItem) -> int:
            env = self.factory()
            try:
                messages = await _call(
                    pool, env.reset, EpisodeItem(item.prompt, item.answer, item.metadata, 0)
                )
                _check_messages(env, messages, "reset")
                return len(self.turn_tokens.prompt(messages))
            finally:
                close = getattr(env, "close", None)
                if close is not None:
                    await _call(pool, close)

        try:
            return list(await asyncio.gather(*(one(item) for item in items)))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _episode(
        self,
        pool,
        item: PromptItem,
        params: SamplingParams,
        model: str,
        version: int,
        seed: int,
        k: int,
    ) -> Episode:
        env = self.factory()
        episode_item = EpisodeItem(item.prompt, item.answer, item.metadata, seed + k)
        first = await _call(pool, env.reset, episode_item)
        _check_messages(env, first, "reset")
        trace = _Trace(self.turn_tokens.prompt(first))
        limit = self.max_prompt_tokens
        if limit is not None and len(trace.prompt_ids) > limit:
            close = getattr(env, "close", None)
            if close is not None:
                await _call(pool, close)
            raise PromptTooLong(
                f"{type(env).__name__}.reset's messages are {len(trace.prompt_ids)} tokens, over "
                f"data.maxPromptTokens={limit} (which counts what the environment adds, e.g. a "
                "tool description): raise data.maxPromptTokens"
            )
        try:
            await asyncio.wait_for(
                self._turns(pool, env, trace, params, model, version, k), self.timeout_s
            )
        except asyncio.TimeoutError:
            trace.ending = "timeout"
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                await _call(pool, close)
        return _finish(trace, version)

    async def _turns(self, pool, env, trace: _Trace, params, model, version, k) -> None:
        for turn in range(self.max_turns):
            left = self.max_total_tokens - len(trace.ids)
            if left <= 0:
                trace.ending = "tokens"
                return
            turn_params = replace(
                params,
                max_tokens=min(self.max_response_tokens, left),
                seed=None if params.seed is None else params.seed + k * self.max_turns + turn,
            )
            [[sample]] = await self.client.agenerate(
                [trace.prompt_ids + trace.ids], 1, turn_params, model=model,
                expected_version=version,
            )  # fmt: skip
            _append(trace, sample.completion_ids, sample.logprobs, 1)
            trace.turns += 1
            v = sample.weight_version
            trace.version = v if trace.version is None else min(v, trace.version)
            trace.endpoint = trace.endpoint or sample.endpoint
            reply = self.turn_tokens.tokenizer.decode(
                sample.completion_ids, skip_special_tokens=True
            )
            trace.last_reply = reply
            if sample.finish_reason == "length":  # cut mid-reply: nothing to answer
                trace.ending = "tokens" if len(trace.ids) >= self.max_total_tokens else "length"
                return
            t0 = time.monotonic()
            try:
                result = await _call(pool, env.step, reply)
            except Exception as exc:  # a broken environment ends its episode, not the step
                log.warning("environment %s failed in step: %s", type(env).__name__, exc)
                trace.ending = "error"
                return
            finally:
                trace.env_calls.append((t0, time.monotonic()))
            if not isinstance(result, EnvStep):
                raise EnvironmentContractError(
                    f"{type(env).__name__}.step returned {type(result).__name__}, not an EnvStep"
                )
            _check_messages(env, result.messages, "step")
            trace.reward += float(result.reward)
            if result.reward:
                trace.turn_rewards.append((len(trace.ids) - 1, float(result.reward)))
            for key, value in result.info.items():
                trace.info[key] = trace.info.get(key, 0.0) + float(value)
            if result.done:
                trace.ending = "done"
                return
            if turn == self.max_turns - 1:
                trace.ending = "turns"
                return
            env_ids = self.turn_tokens.after_turn(sample.completion_ids, result.messages)
            if len(trace.ids) + len(env_ids) >= self.max_total_tokens:
                trace.ending = "tokens"  # no room left for a model turn after them
                return
            _append(trace, env_ids, [0.0] * len(env_ids), 0)


def build_episode_runner(
    job: LoRARLJob, tokenizer: Any, client: RolloutClient
) -> EpisodeRunner | None:
    """The job's episode runner (None without spec.environment); loads the environment class and
    builds one instance now, so a bad entrypoint or params fail the job at start."""
    spec = job.spec
    env = spec.environment
    if env is None:
        return None
    from lorarl.environments.registry import environment_factory

    try:
        factory = environment_factory(env.entrypoint, env.params)
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigError(f"spec.environment: {exc}") from exc
    return EpisodeRunner(
        client=client,
        turn_tokens=TurnTokens(tokenizer, spec.data.chat_template_kwargs),
        factory=factory,
        max_turns=env.max_turns,
        max_total_tokens=env.max_total_tokens,
        max_response_tokens=spec.data.max_response_tokens,
        timeout_s=env.episode_timeout_seconds,
        max_prompt_tokens=spec.data.max_prompt_tokens,
    )


def episode_prompt_lengths(
    job: LoRARLJob, tokenizer: Any, items: Sequence[PromptItem]
) -> list[int] | None:
    """What the load-time prompt filter measures with spec.environment: each row's first prompt
    as the environment sends it (None without an environment: the row's own rendering)."""
    # measuring generates nothing: no client
    runner = build_episode_runner(job, tokenizer, None)  # type: ignore[arg-type]
    if runner is None:
        return None
    return asyncio.run(runner.prompt_lengths(items))


def _append(trace: _Trace, ids: Sequence[int], logprobs: Sequence[float], mask: int) -> None:
    trace.ids.extend(ids)
    trace.logprobs.extend(logprobs)
    trace.mask.extend([mask] * len(ids))


def _finish(trace: _Trace, version: int) -> Episode:
    done = trace.ending == "done"
    sample = Sample(
        prompt_ids=trace.prompt_ids,
        completion_ids=trace.ids,
        logprobs=trace.logprobs,
        finish_reason="stop" if done else "length",
        weight_version=version if trace.version is None else trace.version,
        endpoint=trace.endpoint,
        text=trace.last_reply,
        loss_mask=tuple(trace.mask),
        turn_rewards=tuple(trace.turn_rewards),
    )
    return Episode(
        sample=sample,
        env_reward=trace.reward,
        last_reply=trace.last_reply,
        turns=trace.turns,
        ending=trace.ending,
        info=trace.info,
        env_calls=trace.env_calls,
    )


def episode_rewards(
    items: Sequence[PromptItem],
    groups: Sequence[Sequence[Episode]],
    scorer: Callable | None,
    prompt_text: Callable[[Any], str],
) -> list[float]:
    """Each episode's reward: its environment's rewards, plus `scorer`'s score of the last reply
    against the row's answer (spec.reward, with environment.finalReward; None: not added)."""
    flat = [(item, e) for item, group in zip(items, groups, strict=True) for e in group]
    totals = [e.env_reward for _, e in flat]
    if scorer is not None:
        results = scorer(
            [prompt_text(item.prompt) for item, _ in flat],
            [e.last_reply for _, e in flat],
            [item.answer for item, _ in flat],
            [item.metadata for item, _ in flat],
        )
        totals = [t + float(r.score) for t, r in zip(totals, results, strict=True)]
    return totals


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-step means and sums for the step record (turns, tool calls, environment time)."""
    n = max(len(episodes), 1)
    return {
        "turns_mean": sum(e.turns for e in episodes) / n,
        "tool_calls": sum(e.info.get("tool_calls", 0.0) for e in episodes),
        "tool_errors": sum(e.info.get("tool_errors", 0.0) for e in episodes),
        "environment_seconds": busy_seconds([c for e in episodes for c in e.env_calls]),
    }


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Wall seconds covered by at least one interval: the time environments were running, with
    concurrent episodes counted once."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


async def _call(pool: Executor, method: Callable[..., Any], *args: Any) -> Any:
    """Await an async method; run a plain one on `pool` (a slow tool must not stall the other
    episodes)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    result = await asyncio.get_running_loop().run_in_executor(pool, method, *args)
    return await result if inspect.isawaitable(result) else result


def _check_messages(env: object, messages: object, where: str) -> None:
    name = type(env).__name__
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise EnvironmentContractError(
            f"{name}.{where} must return a list of {{'role': str, 'content': str}} messages, "
            f"got {messages!r:.120}"
        )
    if where == "reset" and not messages:
        raise EnvironmentContractError(f"{name}.reset returned no messages")
