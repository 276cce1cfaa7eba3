"""The RL training loop: one object that owns the parts and runs the steps
(docs/architecture.md#one-rl-step).

Rank 0 generates and scores; every rank trains on its share under FSDP2; rank 0 publishes the new
adapter to the sidecars; checkpoints are collective.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import torch.distributed as dist
from peft import PeftModel
from transformers import AutoTokenizer

from lorarl.api.reports.progress import StepRecord
from lorarl.api.reports.status import EvalRecord, SyncStatus
from lorarl.api.resource import LoRARLJob
from lorarl.plan.engines import SERVED_MODEL_NAME
from lorarl.rewards import get_reward, score_batch
from lorarl.rewards.service.client import RewardServiceClient
from lorarl.sync.adapter_files import adapter_fingerprint
from lorarl.sync.protocol import adapter_name
from lorarl.trainer.checkpoint.export import export_final
from lorarl.trainer.checkpoint.manager import CheckpointManager
from lorarl.trainer.data.prompts import DataPosition, PromptDataset
from lorarl.trainer.data.train_data import TrainData
from lorarl.trainer.episodes.agents import build_agent_runner
from lorarl.trainer.episodes.environment import build_episode_runner, episode_prompt_lengths
from lorarl.trainer.fleet.engine_memory import EngineMemory
from lorarl.trainer.fleet.membership import Fleet
from lorarl.trainer.fleet.publish import WeightPublisher, gather_adapter
from lorarl.trainer.fleet.sync_check import expected_logprobs, job_probe_ids
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.eval import Evaluator, build_evaluator
from lorarl.trainer.generation.rewards import (
    REWARD_READY_TIMEOUT_S,
    score_remote,
    wait_for_reward_service,
)
from lorarl.trainer.generation.rollouts import Collected, RolloutWorker
from lorarl.trainer.generation.sampling import train_sampling
from lorarl.trainer.model.loading import load_base_model
from lorarl.trainer.model.parallel import DistContext
from lorarl.trainer.rl.config import advantage_estimator, algorithm_choices
from lorarl.trainer.rl.overlong import OverlongConfig
from lorarl.trainer.settings import ConfigError, Endpoints, output_dirs, reward_service_client
from lorarl.trainer.telemetry.cpu_util import read_cpu_times, utilisation
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker, Telemetry
from lorarl.trainer.telemetry.samples import due as due_samples
from lorarl.trainer.telemetry.samples import sample_rows
from lorarl.trainer.telemetry.step_record import step_record
from lorarl.trainer.update.batch import TensorBatch, collate, replica_index, shard_for_rank
from lorarl.trainer.update.policy import build_policy
from lorarl.trainer.update.state import StepState
from lorarl.trainer.update.updater import Updater, build_updater

log = logging.getLogger(__name__)
# A replica whose samples' logprob gap is this many times the other replicas' (and above the
# guard's tolerance) is named in a warning.
SAMPLE_MISMATCH_FACTOR = 5.0


@dataclass
class Rank0Parts:
    """What only rank 0 runs: progress and the trackers, the replicas (with sidecars), the
    rollouts, evals and the reward service's client."""

    telemetry: Telemetry
    fleet: Fleet | None  # with sidecars: the live rollout replicas and the weight publisher
    worker: RolloutWorker
    evaluator: Evaluator | None  # when evals are on
    reward_client: RewardServiceClient | None  # with spec.reward.service

    @classmethod
    def from_job(
        cls,
        job: LoRARLJob,
        endpoints: Endpoints,
        ctx: DistContext,
        data: TrainData,
        tokenizer: Any,
        http: httpx.Client,
        probe: list[int] | None,
    ) -> Rank0Parts:
        """In this order: the progress server answers before the fleet waits for sidecars."""
        output_dir = output_dirs(job)[0]
        telemetry = Telemetry.from_job(
            job, output_dir, total_steps=data.total_steps, dropped_prompts=data.dropped,
            progress_port=endpoints.progress_port,
        )  # fmt: skip
        fleet = Fleet.from_job(job, endpoints, http, ctx, probe)
        spec = job.spec
        sampling = train_sampling(spec, tokenizer.eos_token_id)
        ds, choices = spec.algorithm.dynamic_sampling, algorithm_choices(job)
        client = RolloutClient(
            endpoints.rollout, spec.rollout.engine, model_name=SERVED_MODEL_NAME,
            api_key=endpoints.engine_api_key,
        )  # fmt: skip
        telemetry.tracker.watch_engines(client.endpoint_stats)  # the backlog gauges of /metrics
        episodes = build_episode_runner(job, tokenizer, client)  # spec.environment
        agents = build_agent_runner(job, tokenizer, client)  # spec.agent
        scorer, reward_client = build_scorer(job, endpoints.reward)
        worker = RolloutWorker(
            dataset=data.dataset,
            sampler=data.sampler,
            tokenizer=tokenizer,
            client=client,
            scorer=scorer,
            estimator=advantage_estimator(job),
            group_size=spec.algorithm.group_size,
            max_prompt_tokens=spec.data.max_prompt_tokens,
            sampling=sampling,
            dynamic_rounds=ds.max_rounds if choices.dynamic_sampling else 0,
            dynamic_on_shaped=choices.dynamic_metric == "shaped-reward",
            episodes=episodes,
            agents=agents,
            final_reward=spec.environment is None or spec.environment.final_reward,
            turn_rewards=spec.environment is not None and spec.environment.turn_rewards,
            overlong=OverlongConfig(
                max_tokens=episodes.max_total_tokens if episodes else spec.data.max_response_tokens,
                mask=choices.overlong_mask,
                soft_punishment=choices.soft_punishment,
                buffer_tokens=choices.buffer_tokens,
                penalty_factor=choices.penalty_factor,
            ),
        )
        # Evals share the train rollouts' client and reward; None when evals are off.
        evaluator = build_evaluator(
            job, tokenizer, client, worker.scorer, sampling, data.dataset, episodes
        )
        return cls(telemetry, fleet, worker, evaluator, reward_client)


def build_scorer(
    job: LoRARLJob, reward_endpoint: str | None
) -> tuple[Callable, RewardServiceClient | None]:
    """The step's scorer: the reward service's (with its client, closed with the trainer) or
    the spec's reward function in-process."""
    reward = job.spec.reward
    client = reward_service_client(job, reward_endpoint)
    if client is not None:
        return partial(score_remote, client), client
    name = reward.function or reward.entrypoint
    if name is None:  # the spec admits exactly one of them (api/spec/reward.py)
        raise ConfigError("spec.reward: set exactly one of function or entrypoint")
    try:
        fn = get_reward(name, **reward.params)
    except ValueError as exc:
        raise ConfigError(f"spec.reward: {exc}") from exc
    return partial(score_batch, fn), None


def shared_prompt_lengths(
    job: LoRARLJob, ctx: DistContext, tokenizer: Any, loaded: PromptDataset
) -> list[int] | None:
    """With spec.environment, each row's first prompt as the environment sends it (tool
    description included): measured on rank 0, the same list on every rank."""
    if job.spec.environment is None:
        return None
    box: list = [None]
    if ctx.is_main:
        box[0] = episode_prompt_lengths(job, tokenizer, list(loaded))
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id or 0


class Trainer:
    """Runs the steps over parts built elsewhere: `from_job` builds each from the job, in
    order; tests pass their own."""

    def __init__(
        self,
        job: LoRARLJob,
        endpoints: Endpoints,
        ctx: DistContext,
        *,
        data: TrainData,
        tokenizer: Any,
        model: PeftModel,
        updater: Updater,
        checkpoints: CheckpointManager,
        http: httpx.Client,
        engine_memory: EngineMemory,
        probe: list[int] | None = None,
        main: Rank0Parts | None = None,
    ):
        """`http`: the client `engine_memory` and the fleet use, closed with the trainer.
        `probe`: the stale-policy guard's (`job_probe_ids`). `main`: rank 0's parts."""
        self.job, self.endpoints, self.ctx = job, endpoints, ctx
        self.output_dir, _, self.adapter_dir = output_dirs(job)
        self.checkpoints = checkpoints
        self.tokenizer = tokenizer
        self.dataset, self.sampler = data.dataset, data.sampler
        self.dropped_prompts = data.dropped
        self.model = model
        self.updater = updater  # actor-only or PPO
        self.pad_id = pad_token_id(tokenizer)
        self.state = StepState()
        self.tracker: ProgressTracker | None = None
        self.server: ProgressServer | None = None
        self.publisher: WeightPublisher | None = None
        self.fleet: Fleet | None = None  # rank 0 with sidecars: the live rollout replicas
        self.worker: RolloutWorker | None = None
        self.evaluator: Evaluator | None = None  # rank 0, when evals are on
        self.reward_client: RewardServiceClient | None = None
        if main is not None:
            self.tracker, self.server = main.telemetry.tracker, main.telemetry.server
            self.fleet = main.fleet
            self.publisher = main.fleet.publisher if main.fleet is not None else None
            self.worker, self.evaluator = main.worker, main.evaluator
            self.reward_client = main.reward_client
        self._reward_ready = False
        self._http = http
        # Colocated on GPUs the engines lend their memory to each update (engine_memory.py)
        self.engine_memory = engine_memory
        # One-step off-policy: rank 0 generates the next batch on this thread while the step
        # trains; only HTTP and scoring run there, every collective stays on the main thread.
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._prefetched: Future[Collected] | None = None
        self._probe_ids = probe
        self._probe_s = 0.0  # the guard's trainer-side seconds since the last step record

    @classmethod
    def from_job(cls, job: LoRARLJob, endpoints: Endpoints, ctx: DistContext) -> Trainer:
        """Every part built from the job, in the order that matters: the files are read before
        the model loads, `training.totalSteps` is resolved before the schedules are built, and
        rank 0's progress server starts before the fleet waits for sidecars."""
        spec = job.spec
        if not endpoints.rollout:
            raise ConfigError("no rollout endpoints (LORARL_ROLLOUT_ENDPOINTS is empty)")
        checkpoints = CheckpointManager.from_job(job, output_dirs(job)[1])
        loaded = TrainData.read(job)
        remote = spec.model.trust_remote_code
        base = load_base_model(spec.model.path, spec.model.dtype, trust_remote_code=remote)
        tokenizer = AutoTokenizer.from_pretrained(spec.model.path, trust_remote_code=remote)
        lengths = shared_prompt_lengths(job, ctx, tokenizer, loaded)  # collective
        data = TrainData.from_job(job, loaded, tokenizer, lengths=lengths, is_main=ctx.is_main)
        policy = build_policy(job, base, ctx)
        updater = build_updater(job, policy)  # its schedules end at data.total_steps
        http = httpx.Client(timeout=2.0)
        probe = job_probe_ids(
            job, endpoints.sync_world_size, data.dataset, tokenizer, pad_token_id(tokenizer)
        )
        main = None
        if ctx.is_main:
            main = Rank0Parts.from_job(job, endpoints, ctx, data, tokenizer, http, probe)
        fleet = main.fleet if main is not None else None
        engine_memory = EngineMemory.for_job(spec, http, endpoints, lambda: fleet)
        return cls(
            job, endpoints, ctx, data=data, tokenizer=tokenizer, model=policy.model,
            updater=updater, checkpoints=checkpoints, http=http, engine_memory=engine_memory,
            probe=probe, main=main,
        )  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    def resume(self) -> None:
        # collective: every rank resumes the same step; training.resume may refuse here
        ckpt = self.checkpoints.start_from_shared(self.job.spec.training.resume)
        if ckpt is not None:
            updater = self.updater
            loaded = self.checkpoints.load(
                ckpt, self.model, updater.optimizer, critic_optimizer=updater.critic_optimizer
            )
            self.state = StepState.from_dict(loaded.trainer_state)
            updater.load_state_dict(loaded.trainer_state)
            # collective: what the exact-resume check compares with the checkpoint
            fingerprint = adapter_fingerprint(gather_adapter(self.model)) + updater.fingerprint()
            log.info(
                "resumed from %s at step %d (data position %s, adapter %s)",
                ckpt.path, self.state.step, self.state.position.to_dict(), fingerprint,
            )  # fmt: skip
            if self.tracker:
                self.tracker.resume(self.state.step)
                self.tracker.set_checkpoint(self.state.step, str(ckpt.path))
        self._publish()  # engines (re)start from exactly the trainer's weights

    @property
    def total_steps(self) -> int:
        total = self.job.spec.training.total_steps
        if total is None:  # `__init__` resolves training.epochs into it
            raise ConfigError("training.totalSteps is unresolved")
        return total

    def run(self) -> None:
        total = self.total_steps
        try:
            self.resume()
            if self.job.spec.training.eval_before_train and self.state.step == 0:
                baseline = self._evaluate(0)
                if baseline is not None and self.tracker:
                    self.tracker.record_eval(baseline)
            while self.state.step < total:
                self.train_step()
            export_final(self.model, self.job, self.tokenizer, self.adapter_dir)
            if self.tracker:
                self.tracker.finish("Succeeded", adapter_path=str(self.adapter_dir))
        except BaseException as exc:
            if self.tracker:
                self.tracker.finish("Failed", message=str(exc)[:500])
            raise
        finally:
            self.close()

    def close(self) -> None:
        if self._prefetch_pool is not None:
            self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
            self._prefetch_pool = None
        self._http.close()
        if self.reward_client is not None:
            self.reward_client.close()
        if self.publisher:
            self.publisher.close()
            self.publisher = None
        if self.server:
            self.server.stop()
            self.server = None

    # ------------------------------------------------------------------ one step

    def train_step(self) -> StepRecord | None:
        """One RL step: generate, score and compute advantages (rank 0, one broadcast), update,
        publish the new weights, record (rank 0) and checkpoint when due."""
        step = self.state.step + 1
        t_start, cpu_start = time.perf_counter(), read_cpu_times()
        collected = self._collect()
        self.updater.set_lr(step)
        if self.job.spec.training.off_policy_steps and step < self.total_steps:
            self._start_prefetch(collected.position, step + 1)
        t_train = time.perf_counter()
        batch, endpoints = self._my_share(collected)
        metrics = self.updater.update(batch, step, replicas=len(endpoints))
        train_s = time.perf_counter() - t_train
        self.engine_memory.after_update(self.ctx.is_main)  # the engines are back before the sync
        self.state = StepState(step, collected.position, step)
        self._finish_prefetch()  # the engines must be idle before their weights change
        sync = self._publish()
        record = None
        if self.ctx.is_main and self.tracker is not None:
            record = step_record(
                step, collected, metrics, train_s=train_s, sync=sync, t_start=t_start,
                lr=self.updater.lr, cpu_util=utilisation(cpu_start, read_cpu_times()),
            )  # fmt: skip
            self._record(step, record, collected, metrics, endpoints, sync, self.tracker)
        self._checkpoint_if_due(step)
        return record

    def _my_share(self, collected: Collected) -> tuple[TensorBatch, list[str]]:
        """This rank's samples as tensors on its device, and the whole step's engines (every
        rank numbers them alike)."""
        samples = collected.samples
        mine = shard_for_rank(samples, self.ctx.rank, self.ctx.world_size)
        endpoints = replica_index(samples)
        return collate(mine, self.pad_id, self.ctx.device, endpoints), endpoints

    def _record(
        self,
        step: int,
        record: StepRecord,
        collected: Collected,
        metrics: dict[str, float],
        endpoints: list[str],
        sync: SyncStatus | None,
        tracker: ProgressTracker,
    ) -> None:
        """Rank 0: the step record's trainer-side parts, the eval when due, the samples."""
        spec = self.job.spec
        record.logprob_mismatch_by_replica = self._mismatch_by_replica(metrics, endpoints)
        if self.fleet is not None and self.fleet.guard is not None:
            probe_s, record.sync_check_gap = self.fleet.guard.take_seconds()
            record.sync_check_seconds, self._probe_s = self._probe_s + probe_s, 0.0
        if self._eval_due(step):  # after the step's timings: its time is in none of them
            record.eval = self._evaluate(step)
        tracker.record(record, sync)
        if due_samples(step, spec.training):
            tracker.record_samples(step, sample_rows(
                step, collected.samples, self.tokenizer, spec.training.samples_per_step
            ))  # fmt: skip

    def _checkpoint_if_due(self, step: int) -> None:
        """Every checkpointInterval steps and after the last one (collective)."""
        if step % self.job.spec.training.checkpoint_interval != 0 and step != self.total_steps:
            return
        updater = self.updater
        state = {**self.state.to_dict(), **updater.state_dict()}
        path = self.checkpoints.save(
            step, self.model, updater.optimizer, state, critic_optimizer=updater.critic_optimizer
        )
        if self.tracker:
            self.tracker.set_checkpoint(step, str(path))

    def _mismatch_by_replica(
        self, metrics: dict[str, float], endpoints: list[str]
    ) -> dict[str, float] | None:
        """The update's per-engine gap by replica name; warns about a replica far above the
        others (the stale-policy guard's second signal: its probe proves the weights, this
        watches every sample)."""
        if self.fleet is not None:
            names = self.fleet.names
        else:
            names = {url: f"rollout-{i}" for i, url in enumerate(self.endpoints.rollout)}
        by = {
            names.get(url, url): metrics[f"replica_mismatch/{k}"]
            for k, url in enumerate(endpoints)
            if f"replica_mismatch/{k}" in metrics
        }
        guard = self.fleet.guard if self.fleet is not None else None
        if guard is not None and len(by) > 1:
            for name, gap in by.items():
                others = sorted(v for n, v in by.items() if n != name)
                typical = others[len(others) // 2]
                if gap > guard.tolerance and gap > SAMPLE_MISMATCH_FACTOR * typical:
                    log.warning(
                        "%s: its samples' logprobs are %.3g per token from the trainer's, the "
                        "other replicas' %.3g: it may not serve the weights it was sent",
                        name, gap, typical,
                    )  # fmt: skip
        return by or None

    def _eval_due(self, step: int) -> bool:
        t = self.job.spec.training
        return t.eval_interval > 0 and (step % t.eval_interval == 0 or step == t.total_steps)

    def _evaluate(self, step: int) -> EvalRecord | None:
        """Eval of the weights the engines serve now (the step's, synced and, with prefetch, no
        generation in flight). An engine or reward failure is logged and the run goes on."""
        if self.evaluator is None:
            return None
        version = self.state.version
        try:
            self._engines_ready()
            mode = self.job.spec.rollout.sync_mode
            name = adapter_name(version) if mode == "adapter" else SERVED_MODEL_NAME
            record = self.evaluator.run(step, version, name)
        except Exception as exc:  # an eval is a measurement: it never fails the run
            log.warning("eval at step %d failed; training goes on: %s", step, exc)
            return None
        log.info("%s", record.line())
        return record

    def _collect(self) -> Collected:
        """Rank 0 generates and scores (or takes the batch generated during the last step);
        everyone gets the same samples (one broadcast)."""
        box: list = [None]
        if self.ctx.is_main:
            if self._prefetched is not None:
                box[0], self._prefetched = self._prefetched.result(), None
            else:
                state = self.state
                box[0] = self._generate(state.position, state.step + 1, state.version)
            self.engine_memory.release()  # before the broadcast lets any rank start its update
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _generate(self, position: DataPosition, step: int, version: int) -> Collected:
        """Samples for `step` from `position`, by weights `version` (what the engines serve)."""
        names = self._engines_ready()
        mode = self.job.spec.rollout.sync_mode
        name = adapter_name(version) if mode == "adapter" else SERVED_MODEL_NAME
        worker = self._rollouts
        client = worker.client
        before = client.requests_by_endpoint()
        collected = worker.collect(position, version, name, step=step)
        sent = client.requests_by_endpoint()
        collected.engine_requests = {
            names.get(url, url): count - before.get(url, 0)
            for url, count in sent.items()
            if count > before.get(url, 0) or url in names
        }
        collected.engine_rewards = {
            names.get(url, url): mean for url, mean in (collected.engine_rewards or {}).items()
        }
        return collected

    @property
    def _rollouts(self) -> RolloutWorker:
        """Rank 0's rollout worker: only rank 0 generates."""
        if self.worker is None:
            raise RuntimeError("only rank 0 generates")
        return self.worker

    def _engines_ready(self) -> dict[str, str]:
        """Route to the engines on the current weights (engine URL -> replica name); wait for
        the reward service once."""
        if self.fleet is not None:
            names = self.fleet.serving()  # brings joined replicas up to date first
            self._rollouts.client.set_endpoints(list(names))
        else:
            names = {url: f"rollout-{i}" for i, url in enumerate(self.endpoints.rollout)}
        if self.reward_client is not None and not self._reward_ready:
            # A reward service started beside the trainer needs seconds to come up (Ray, then
            # Serve); the client's retries are for blips, not for start-up.
            wait_for_reward_service(self.reward_client, REWARD_READY_TIMEOUT_S)
            self._reward_ready = True
        return names

    def _start_prefetch(self, position: DataPosition, step: int) -> None:
        """Generate `step`'s batch now, by the weights published before this step trains."""
        if not self.ctx.is_main:
            return
        if self._prefetch_pool is None:
            self._prefetch_pool = ThreadPoolExecutor(1, thread_name_prefix="lorarl-prefetch")
        version = self.state.version  # read here: the main thread moves it on after the update
        self._prefetched = self._prefetch_pool.submit(self._generate, position, step, version)

    def _finish_prefetch(self) -> None:
        """Wait for the batch being generated; its errors surface here, in this step."""
        if self._prefetched is not None:
            self._prefetched.result()

    def _publish(self) -> SyncStatus | None:
        if self.endpoints.sync_world_size <= 1:
            return None
        tensors = gather_adapter(self.model)  # collective
        probe, expected = self._probe_ids, None
        if probe is not None:  # collective: what the engines must answer
            start = time.perf_counter()
            expected = expected_logprobs(self.model, probe, self.ctx.device)
            self._probe_s += time.perf_counter() - start
        if not self.ctx.is_main or self.fleet is None:  # rank 0 has a fleet with sidecars
            return None
        if probe is not None and expected is not None and self.fleet.guard is not None:
            self.fleet.guard.expect(self.state.version, probe, expected)
        return self.fleet.publish(self.model, tensors, self.state.version)
