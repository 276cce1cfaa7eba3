"""The RL training loop: one object that owns the parts and runs the steps
(docs/architecture.md#one-rl-step).

Rank 0 generates and scores; every rank trains on its share under FSDP2; rank 0 publishes the new
adapter to the sidecars; checkpoints are collective.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import httpx
import torch.distributed as dist
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
from lorarl.trainer.checkpoint.manager import CheckpointManager, job_uid_from_env
from lorarl.trainer.data.epochs import resolve_total_steps
from lorarl.trainer.data.prompts import (
    DataPosition,
    PromptDataset,
    PromptSampler,
    drop_long_prompts,
    encode_prompts,
)
from lorarl.trainer.episodes.agents import build_agent_runner
from lorarl.trainer.episodes.environment import build_episode_runner, episode_prompt_lengths
from lorarl.trainer.fleet.engine_memory import EngineMemory
from lorarl.trainer.fleet.membership import Fleet
from lorarl.trainer.fleet.publish import WeightPublisher, gather_adapter
from lorarl.trainer.fleet.sync_check import (
    DEFAULT_TOLERANCE,
    SyncCheck,
    expected_logprobs,
    probe_ids,
)
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
from lorarl.trainer.model.parallel import DistContext, compute_dtype
from lorarl.trainer.rl.config import advantage_estimator, algorithm_choices
from lorarl.trainer.rl.overlong import OverlongConfig
from lorarl.trainer.settings import ConfigError, Endpoints, output_dirs, reward_service_client
from lorarl.trainer.telemetry.cpu_util import read_cpu_times, utilisation
from lorarl.trainer.telemetry.progress import ProgressServer, ProgressTracker
from lorarl.trainer.telemetry.samples import due as due_samples
from lorarl.trainer.telemetry.samples import sample_rows
from lorarl.trainer.telemetry.step_record import step_record
from lorarl.trainer.telemetry.tracking import build_fanout
from lorarl.trainer.update.batch import TensorBatch, collate, replica_index, shard_for_rank
from lorarl.trainer.update.policy import build_policy
from lorarl.trainer.update.state import StepState
from lorarl.trainer.update.updater import Updater, build_updater

log = logging.getLogger(__name__)
# A replica whose samples' logprob gap is this many times the other replicas' (and above the
# guard's tolerance) is named in a warning.
SAMPLE_MISMATCH_FACTOR = 5.0


class Trainer:
    def __init__(self, job: LoRARLJob, endpoints: Endpoints, ctx: DistContext):
        self.job, self.endpoints, self.ctx = job, endpoints, ctx
        spec = job.spec
        self.estimator = advantage_estimator(job)
        if not endpoints.rollout:
            raise ConfigError("no rollout endpoints (LORARL_ROLLOUT_ENDPOINTS is empty)")
        self.output_dir, ckpt_dir, self.adapter_dir = output_dirs(job)
        self.checkpoints = CheckpointManager(
            ckpt_dir, spec.training.keep_checkpoints, job_uid=job_uid_from_env()
        )
        loaded = PromptDataset.from_files(
            spec.data.train_files, spec.data.prompt_key, spec.data.answer_key,
            system_prompt=spec.data.system_prompt,
            chat_template_kwargs=spec.data.chat_template_kwargs,
        )  # fmt: skip
        remote = spec.model.trust_remote_code
        base = load_base_model(spec.model.path, spec.model.dtype, trust_remote_code=remote)
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model.path, trust_remote_code=remote)
        self.dataset, self.dropped_prompts = drop_long_prompts(
            loaded, self.tokenizer, spec.data.max_prompt_tokens,
            lengths=self._prompt_lengths(loaded),
        )  # fmt: skip
        if self.dropped_prompts and ctx.is_main:
            log.warning(
                "dropped %d of %d prompts longer than data.maxPromptTokens=%d",
                self.dropped_prompts, len(loaded), spec.data.max_prompt_tokens,
            )  # fmt: skip
        # training.epochs becomes a step count now that the rows are known; written into this
        # process's spec, every use below (schedule, evals, the last checkpoint, progress) sees
        # the real total.
        total = resolve_total_steps(job, len(self.dataset))
        if spec.training.epochs is not None and ctx.is_main:
            log.info(
                "training.epochs %g over %d prompts at %d per step: %d steps",
                spec.training.epochs, len(self.dataset), spec.training.prompts_per_step, total,
            )  # fmt: skip
        spec.training.total_steps = total
        self.sampler = PromptSampler(
            len(self.dataset), spec.training.prompts_per_step, spec.data.seed, spec.data.shuffle
        )
        policy = build_policy(job, base, ctx)
        self.model = policy.model
        self.updater: Updater = build_updater(job, policy)  # actor-only or PPO
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id or 0
        self.state = StepState()
        self.tracker: ProgressTracker | None = None
        self.server: ProgressServer | None = None
        self.publisher: WeightPublisher | None = None
        self.fleet: Fleet | None = None  # rank 0 with sidecars: the live rollout replicas
        self.worker: RolloutWorker | None = None
        self.evaluator: Evaluator | None = None  # rank 0, when evals are on
        self.reward_client: RewardServiceClient | None = None
        self._reward_ready = False
        self._http = httpx.Client(timeout=2.0)
        # Colocated on GPUs the engines lend their memory to each update (engine_memory.py)
        self.engine_memory = EngineMemory.for_job(spec, self._http, endpoints, lambda: self.fleet)
        # One-step off-policy: rank 0 generates the next batch on this thread while the step
        # trains; only HTTP and scoring run there, every collective stays on the main thread.
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._prefetched: Future[Collected] | None = None
        self._probe_ids = self._run_probe_ids()
        self._probe_s = 0.0  # the guard's trainer-side seconds since the last step record
        if ctx.is_main:
            self._setup_main()

    def _prompt_lengths(self, loaded: PromptDataset) -> list[int] | None:
        """With spec.environment, each row's first prompt as the environment sends it (tool
        description included): measured on rank 0, the same list on every rank."""
        if self.job.spec.environment is None:
            return None
        box: list = [None]
        if self.ctx.is_main:
            box[0] = episode_prompt_lengths(self.job, self.tokenizer, list(loaded))
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def _setup_main(self) -> None:
        spec, ep = self.job.spec, self.endpoints
        self.tracker = ProgressTracker(self.job.name, self.total_steps, self.output_dir)
        self.tracker.progress.dropped_prompts = self.dropped_prompts
        self.tracker.tracking = build_fanout(self.job, self.output_dir)  # spec.logging
        if ep.progress_port is not None:
            self.server = ProgressServer(self.tracker, ep.progress_port)
            self.server.start()
        if ep.sync_world_size > 1:
            if ep.sync_addr is None or ep.sync_port is None or ep.sync_backend is None:
                raise ConfigError(
                    "LORARL_SYNC_ADDR/LORARL_SYNC_PORT/LORARL_SYNC_BACKEND are required with "
                    "sidecars"
                )
            self.publisher = WeightPublisher(
                ep.sync_addr, ep.sync_port, spec.rollout.sync_mode, backend=ep.sync_backend,
                wire_dtype=compute_dtype(self.ctx, spec.trainer.fsdp.mixed_precision),
            )  # fmt: skip
            # Who receives each sync and who generates: the replicas registered now, not the
            # ones in this env (docs/architecture.md#live-membership).
            self.fleet = Fleet(
                self.publisher, self._http, initial_members=len(ep.rollout), guard=self._guard()
            )
        sampling = train_sampling(spec, self.tokenizer.eos_token_id)
        ds, choices = spec.algorithm.dynamic_sampling, algorithm_choices(self.job)
        client = RolloutClient(
            ep.rollout, spec.rollout.engine, model_name=SERVED_MODEL_NAME, api_key=ep.engine_api_key
        )
        self.tracker.watch_engines(client.endpoint_stats)  # the backlog gauges of GET /metrics
        episodes = build_episode_runner(self.job, self.tokenizer, client)  # spec.environment
        agents = build_agent_runner(self.job, self.tokenizer, client)  # spec.agent
        self.worker = RolloutWorker(
            dataset=self.dataset,
            sampler=self.sampler,
            tokenizer=self.tokenizer,
            client=client,
            scorer=self._scorer(),
            estimator=self.estimator,
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
        self.evaluator = build_evaluator(
            self.job, self.tokenizer, client, self.worker.scorer, sampling, self.dataset, episodes
        )

    def _guard(self) -> SyncCheck | None:
        """Rank 0's stale-policy guard (spec.rollout.syncCheck), None when it is off."""
        if self._probe_ids is None:
            return None
        spec = self.job.spec
        check = spec.rollout.sync_check
        return SyncCheck(
            self._http,
            spec.rollout.engine,
            spec.rollout.sync_mode,
            SERVED_MODEL_NAME,
            tolerance=check.tolerance or DEFAULT_TOLERANCE[spec.model.dtype],
            api_key=self.endpoints.engine_api_key,
        )

    def _run_probe_ids(self) -> list[int] | None:
        """The guard's probe (every rank: each takes part in its forward): the first training
        prompt and its reference answer, as the engines would tokenize them."""
        spec = self.job.spec
        if self.endpoints.sync_world_size <= 1 or not spec.rollout.sync_check.enabled:
            return None
        item = self.dataset[0]
        prompt = encode_prompts(
            self.tokenizer, [item.prompt], spec.data.max_prompt_tokens, truncate=True,
            chat_template_kwargs=self.dataset.chat_template_kwargs,
        )[0]  # fmt: skip
        answer = item.answer if isinstance(item.answer, str) else ""
        answer_ids = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        if len(prompt) + len(answer_ids) < 2:  # a one-token prompt, no answer: end it
            answer_ids = [*answer_ids, self.pad_id]
        return probe_ids(prompt, answer_ids)

    def _scorer(self):
        reward = self.job.spec.reward
        self.reward_client = reward_service_client(self.job, self.endpoints.reward)
        if self.reward_client is not None:
            return partial(score_remote, self.reward_client)
        try:
            fn = get_reward(reward.function or reward.entrypoint, **reward.params)
        except ValueError as exc:
            raise ConfigError(f"spec.reward: {exc}") from exc
        return partial(score_batch, fn)

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
