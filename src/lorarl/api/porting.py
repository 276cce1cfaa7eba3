"""verl and SkyRL parameter names, and the LoRARLJob field each one is.

One table, so `lorarl validate` can answer a verl user's `lora_rank` with `spec.lora.rank` (and
anything else that ports a job can read the same facts). `field` is None where lorarl has no
setting for the parameter; `note` says what differs (a unit, a name) or why there is none.
Names are the frameworks' dotted config paths (Hydra overrides); a user may write a full path, a
nested tree of it, or only its last part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VERL = "verl"
SKYRL = "SkyRL"

_PROMPTS_NOT_SAMPLES = (
    "which counts prompts, where miniBatchSize counts samples (prompts x spec.algorithm.groupSize)"
)
_EPOCHS = "lorarl counts steps: epochs x training prompts / spec.training.promptsPerStep"


@dataclass(frozen=True)
class ForeignName:
    framework: str
    name: str  # the framework's dotted config path
    field: str | None  # the LoRARLJob field path; None: no equivalent
    note: str = ""


def _names(framework: str, prefix: str, pairs: Sequence[tuple]) -> list[ForeignName]:
    return [ForeignName(framework, f"{prefix}{p[0]}", *p[1:]) for p in pairs]


# The actor's (policy's) names come before the critic's: where a short name fits both (`lr`),
# the first is the one suggested unless the manifest's location says otherwise.
FOREIGN_NAMES: tuple[ForeignName, ...] = (
    *_names(VERL, "actor_rollout_ref.model.", [
        ("path", "spec.model.path"),
        ("trust_remote_code", "spec.model.trustRemoteCode"),
        ("lora_rank", "spec.lora.rank"),
        ("lora_alpha", "spec.lora.alpha"),
        ("target_modules", "spec.lora.targetModules"),
        ("exclude_modules", "spec.lora.excludeModules"),
        ("lora_adapter_path", "spec.lora.adapterPath"),
        ("lora.rank", "spec.lora.rank"),
        ("lora.alpha", "spec.lora.alpha"),
        ("lora.dropout", "spec.lora.dropout"),
        ("lora.target_modules", "spec.lora.targetModules"),
        ("lora.exclude_modules", "spec.lora.excludeModules"),
        ("lora.adapter_path", "spec.lora.adapterPath"),
        ("use_shm", None, "the model is read from spec.model.path as it is (no copy to /dev/shm)"),
        ("enable_gradient_checkpointing", None, "lorarl has no activation checkpointing setting"),
    ]),
    *_names(VERL, "actor_rollout_ref.actor.", [
        ("optim.lr", "spec.optim.lr"),
        ("optim.lr_warmup_steps", "spec.optim.warmupSteps"),
        ("optim.warmup_style", "spec.optim.scheduler"),
        ("optim.lr_scheduler_type", "spec.optim.scheduler"),
        ("optim.weight_decay", "spec.optim.weightDecay"),
        ("optim.betas", "spec.optim.betas"),
        ("optim.clip_grad", "spec.optim.gradClip"),
        ("grad_clip", "spec.optim.gradClip"),
        ("ppo_mini_batch_size", "spec.training.miniBatchSize", _PROMPTS_NOT_SAMPLES),
        ("ppo_micro_batch_size_per_gpu", "spec.training.microBatchSize"),
        ("ppo_epochs", "spec.algorithm.ppoEpochs"),
        ("clip_ratio", "spec.algorithm.clipRatioLow", "set clipRatioLow and clipRatioHigh"),
        ("clip_ratio_low", "spec.algorithm.clipRatioLow"),
        ("clip_ratio_high", "spec.algorithm.clipRatioHigh"),
        ("clip_ratio_c", "spec.algorithm.dualClip"),
        ("loss_agg_mode", "spec.algorithm.lossAggregation"),
        ("entropy_coeff", "spec.algorithm.entropyCoef"),
        ("use_kl_loss", "spec.algorithm.kl.coef", "a KL loss is on when kl.coef > 0"),
        ("kl_loss_coef", "spec.algorithm.kl.coef"),
        ("kl_loss_type", "spec.algorithm.kl.estimator"),
        ("fsdp_config.reshard_after_forward", "spec.trainer.fsdp.reshardAfterForward"),
    ]),
    *_names(VERL, "actor_rollout_ref.rollout.", [
        ("n", "spec.algorithm.groupSize"),
        ("name", "spec.rollout.engine"),
        ("tensor_model_parallel_size", "spec.rollout.tensorParallelSize"),
        ("gpu_memory_utilization", "spec.rollout.memoryFraction"),
        ("temperature", "spec.rollout.sampling.temperature"),
        ("top_p", "spec.rollout.sampling.topP"),
        ("top_k", "spec.rollout.sampling.topK"),
        ("val_kwargs.n", "spec.training.eval.n"),
        ("val_kwargs.temperature", "spec.training.eval.temperature"),
        ("val_kwargs.top_p", "spec.training.eval.topP"),
    ]),
    *_names(VERL, "data.", [
        ("train_files", "spec.data.trainFiles"),
        ("val_files", "spec.data.valFiles"),
        ("prompt_key", "spec.data.promptKey"),
        ("max_prompt_length", "spec.data.maxPromptTokens", "longer prompts are dropped"),
        ("max_response_length", "spec.data.maxResponseTokens"),
        ("train_batch_size", "spec.training.promptsPerStep"),
        ("shuffle", "spec.data.shuffle"),
        ("seed", "spec.data.seed"),
    ]),
    *_names(VERL, "algorithm.", [
        ("adv_estimator", "spec.algorithm.name", "verl's gae is ppo, reinforce_plus_plus is "
         "reinforce_pp"),
        ("gamma", "spec.algorithm.gamma"),
        ("lam", "spec.algorithm.lam"),
        ("use_kl_in_reward", "spec.algorithm.kl.inReward"),
        ("kl_penalty", "spec.algorithm.kl.estimator"),
        ("kl_ctrl.kl_coef", "spec.algorithm.kl.coef"),
        ("kl_ctrl.type", "spec.algorithm.kl.controller"),
        ("kl_ctrl.target_kl", "spec.algorithm.kl.targetKl"),
        ("kl_ctrl.horizon", "spec.algorithm.kl.horizon"),
        ("filter_groups.enable", "spec.algorithm.dynamicSampling.enabled"),
        ("filter_groups.max_num_gen_batches", "spec.algorithm.dynamicSampling.maxRounds"),
        ("filter_groups.metric", "spec.algorithm.dynamicSampling.metric"),
    ]),
    *_names(VERL, "reward_model.overlong_buffer.", [
        ("enable", "spec.algorithm.overlong.softPunishment"),
        ("len", "spec.algorithm.overlong.bufferTokens"),
        ("penalty_factor", "spec.algorithm.overlong.penaltyFactor"),
    ]),
    *_names(VERL, "custom_reward_function.", [
        ("path", "spec.reward.entrypoint", "an importable module:function"),
        ("name", "spec.reward.entrypoint", "an importable module:function"),
    ]),
    *_names(VERL, "trainer.", [
        ("total_training_steps", "spec.training.totalSteps"),
        ("total_epochs", "spec.training.totalSteps", _EPOCHS),
        ("save_freq", "spec.training.checkpointInterval"),
        ("test_freq", "spec.training.evalInterval"),
        ("val_before_train", "spec.training.evalBeforeTrain"),
        ("default_local_dir", "spec.training.outputDir"),
        ("max_actor_ckpt_to_keep", "spec.training.keepCheckpoints"),
        ("project_name", "spec.logging.wandb.project"),
        ("logger", "spec.logging.backends"),
        ("nnodes", "spec.trainer.replicas"),
        ("n_gpus_per_node", "spec.trainer.gpusPerReplica", "rollout GPUs are set apart: "
         "spec.rollout.gpusPerReplica"),
        ("critic_warmup", "spec.critic.warmupSteps"),
    ]),
    *_names(VERL, "critic.", [
        ("optim.lr", "spec.critic.optim.lr"),
        ("optim.weight_decay", "spec.critic.optim.weightDecay"),
        ("optim.lr_warmup_steps", "spec.critic.optim.warmupSteps"),
        ("optim.clip_grad", "spec.critic.optim.gradClip"),
        ("grad_clip", "spec.critic.optim.gradClip"),
        ("cliprange_value", "spec.critic.valueClip"),
        ("model.lora_rank", "spec.critic.lora.rank"),
        ("model.lora_alpha", "spec.critic.lora.alpha"),
        ("model.target_modules", "spec.critic.lora.targetModules"),
        ("model.exclude_modules", "spec.critic.lora.excludeModules"),
    ]),
    *_names(SKYRL, "trainer.policy.", [
        ("model.path", "spec.model.path"),
        ("model.lora.rank", "spec.lora.rank"),
        ("model.lora.alpha", "spec.lora.alpha"),
        ("model.lora.dropout", "spec.lora.dropout"),
        ("model.lora.target_modules", "spec.lora.targetModules"),
        ("model.lora.exclude_modules", "spec.lora.excludeModules"),
        ("optimizer_config.lr", "spec.optim.lr"),
        ("optimizer_config.adam_betas", "spec.optim.betas"),
        ("optimizer_config.weight_decay", "spec.optim.weightDecay"),
        ("optimizer_config.max_grad_norm", "spec.optim.gradClip"),
        ("optimizer_config.num_warmup_steps", "spec.optim.warmupSteps"),
        ("optimizer_config.scheduler", "spec.optim.scheduler"),
        ("fsdp_config.reshard_after_forward", "spec.trainer.fsdp.reshardAfterForward"),
    ]),
    *_names(SKYRL, "trainer.", [
        ("train_batch_size", "spec.training.promptsPerStep"),
        ("policy_mini_batch_size", "spec.training.miniBatchSize", _PROMPTS_NOT_SAMPLES),
        ("micro_train_batch_size_per_gpu", "spec.training.microBatchSize"),
        ("update_epochs_per_batch", "spec.algorithm.ppoEpochs"),
        ("epochs", "spec.training.totalSteps", _EPOCHS),
        ("eval_interval", "spec.training.evalInterval"),
        ("eval_before_train", "spec.training.evalBeforeTrain"),
        ("ckpt_interval", "spec.training.checkpointInterval"),
        ("ckpt_path", "spec.training.outputDir"),
        ("export_path", "spec.training.outputDir"),
        ("max_ckpts_to_keep", "spec.training.keepCheckpoints"),
        ("max_prompt_length", "spec.data.maxPromptTokens", "longer prompts are dropped"),
        ("target_modules", "spec.lora.targetModules"),
        ("seed", "spec.training.seed"),
        ("project_name", "spec.logging.wandb.project"),
        ("logger", "spec.logging.backends"),
        ("gradient_checkpointing", None, "lorarl has no activation checkpointing setting"),
        ("algorithm.advantage_estimator", "spec.algorithm.name", "SkyRL's gae is ppo"),
        ("algorithm.kl_loss_coef", "spec.algorithm.kl.coef"),
        ("algorithm.use_kl_loss", "spec.algorithm.kl.coef", "a KL loss is on when kl.coef > 0"),
        ("algorithm.use_kl_in_reward", "spec.algorithm.kl.inReward"),
        ("algorithm.eps_clip_low", "spec.algorithm.clipRatioLow"),
        ("algorithm.eps_clip_high", "spec.algorithm.clipRatioHigh"),
        ("algorithm.clip_ratio_c", "spec.algorithm.dualClip"),
        ("algorithm.loss_reduction", "spec.algorithm.lossAggregation"),
        ("algorithm.gamma", "spec.algorithm.gamma"),
        ("algorithm.lambd", "spec.algorithm.lam"),
        ("algorithm.value_clip", "spec.critic.valueClip"),
        ("critic.optimizer_config.lr", "spec.critic.optim.lr"),
        ("critic.model.lora.rank", "spec.critic.lora.rank"),
        ("critic.model.lora.alpha", "spec.critic.lora.alpha"),
        ("critic.model.lora.target_modules", "spec.critic.lora.targetModules"),
    ]),
    *_names(SKYRL, "generator.", [
        ("n_samples_per_prompt", "spec.algorithm.groupSize"),
        ("backend", "spec.rollout.engine"),
        ("num_inference_engines", "spec.rollout.replicas"),
        ("inference_engine_tensor_parallel_size", "spec.rollout.tensorParallelSize"),
        ("gpu_memory_utilization", "spec.rollout.memoryFraction"),
        ("max_turns", "spec.environment.maxTurns"),
        ("sampling_params.max_generate_length", "spec.data.maxResponseTokens"),
        ("sampling_params.temperature", "spec.rollout.sampling.temperature"),
        ("sampling_params.top_p", "spec.rollout.sampling.topP"),
        ("sampling_params.top_k", "spec.rollout.sampling.topK"),
        ("sampling_params.min_p", "spec.rollout.sampling.minP"),
        ("eval_n_samples_per_prompt", "spec.training.eval.n"),
        ("eval_sampling_params.max_generate_length", "spec.training.eval.maxTokens"),
        ("eval_sampling_params.temperature", "spec.training.eval.temperature"),
        ("eval_sampling_params.top_p", "spec.training.eval.topP"),
        ("eval_sampling_params.min_p", "spec.training.eval.minP"),
    ]),
    *_names(SKYRL, "data.", [
        ("train_data", "spec.data.trainFiles"),
        ("val_data", "spec.data.valFiles"),
    ]),
)  # fmt: skip


def _suffixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


_BY_SUFFIX: dict[str, list[ForeignName]] = {}
for _entry in FOREIGN_NAMES:
    for _suffix in _suffixes(_entry.name):
        _BY_SUFFIX.setdefault(_suffix, []).append(_entry)


def _distinctive(suffix: str) -> bool:
    """A name that means one thing on its own: dotted (`rollout.n`) or snake_case (`lora_rank`),
    not a bare word (`n`, `path`, `name`) that many configs use for many things."""
    return "." in suffix or "_" in suffix


def foreign_name(segments: Sequence[str]) -> tuple[str, list[ForeignName]] | None:
    """The longest trailing part of `segments` (a path as the manifest writes it) that is a
    verl or SkyRL parameter, with its table entries (several where frameworks share a name)."""
    for start in range(len(segments)):
        suffix = ".".join(segments[start:])
        found = _BY_SUFFIX.get(suffix)
        if found and _distinctive(suffix):
            return suffix, found
    return None
