"""verl, SkyRL and RLinf parameter names, and the LoRARLJob field each one is.

One table, so `lorarl validate` can answer a verl user's `lora_rank` with `spec.lora.rank` (and
anything else that ports a job can read the same facts). `field` is None where lorarl has no
setting for the parameter; `note` says what differs (a unit, a name) or why there is none.
Names are the frameworks' dotted config paths (Hydra overrides; RLinf's YAML keys, flattened);
a user may write a full path, a nested tree of it, or only its last part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VERL = "verl"
SKYRL = "SkyRL"
RLINF = "RLinf"

_PROMPTS_NOT_SAMPLES = (
    "which counts prompts, where miniBatchSize counts samples (prompts x spec.algorithm.groupSize)"
)
_EPOCHS = "the trainer runs ceil(epochs x rows / promptsPerStep) steps"
_OFFLOAD = "parameters, gradients and optimizer state offload together"
_KL_ON = "a KL loss is on when kl.coef > 0"
_SEPARATE = (
    "engines and trainer are separate servers (spec.rollout.placement: colocated shares GPUs)"
)
_OWN_BATCHING = "lorarl batches by spec.training.microBatchSize (and maxTokensPerMicroBatch)"
_MICRO = "log-probs are computed in spec.training.microBatchSize batches"
_SYNC = "weights reach the engines by lorarl's own sync (spec.rollout.syncMode)"
_ENGINE_ARGS = "an engine flag: pass it in spec.rollout.engineArgs if needed"
_FSDP2 = "lorarl's trainer is FSDP2 (sharded data parallel): no Megatron model parallelism"
_NO_SP = "lorarl has no sequence parallelism"
_TOOLS = ("verl tool classes: tool_calling has built-in tools (environment.params.tools); "
          "others need your own environment class")  # fmt: skip
_ENGINE_PP = "lorarl's engines shard by tensor parallelism only"
_KERNELS = "lorarl chooses its own kernels"
_SAMPLE = "engines always sample (temperature 0 is greedy)"
_MATPO = (
    "MATPO's sub-agent summaries: a behaviour of its agent loop; your agent function "
    "(spec.agent) writes them (docs/environments.md#matpo-a-manifest-and-an-agent-function)"
)
# The notes of the settings that cannot apply to lorarl's design (ForeignName.cannot_apply).
_CANNOT = (_FSDP2, _NO_SP, _TOOLS, _MATPO, _ENGINE_PP)
_REF = "the reference policy is the base model with the LoRA adapter off: no worker of its own"


@dataclass(frozen=True)
class ForeignName:
    framework: str
    name: str  # the framework's dotted config path
    field: str | None  # the LoRARLJob field path; None: no equivalent
    note: str = ""
    # How `lorarl import` turns the value into the field's (lorarl.importer.CONVERSIONS names
    # each); "": the value as it is.
    convert: str = ""
    # No field, because the setting cannot apply to lorarl's design (its note says why); other
    # rows without a field are settings lorarl needs none of.
    cannot_apply: bool = False


def _names(framework: str, prefix: str, pairs: Sequence[tuple]) -> list[ForeignName]:
    """Rows `(name, field[, note[, convert]])` under `prefix`."""
    out = []
    for name, field, *rest in pairs:
        note, convert = (*rest, "", "")[:2]
        cannot = field is None and note in _CANNOT
        out.append(ForeignName(framework, f"{prefix}{name}", field, note, convert, cannot))
    return out


# The actor's (policy's) names come before the critic's: where a short name fits both (`lr`),
# the first is the one suggested unless the manifest's location says otherwise.
FOREIGN_NAMES: tuple[ForeignName, ...] = (
    *_names(VERL, "actor_rollout_ref.model.", [
        ("path", "spec.model.path", "", "model"),
        ("trust_remote_code", "spec.model.trustRemoteCode"),
        ("lora_rank", "spec.lora.rank"),
        ("lora_alpha", "spec.lora.alpha"),
        ("target_modules", "spec.lora.targetModules", "", "list"),
        ("exclude_modules", "spec.lora.excludeModules"),
        ("lora_adapter_path", "spec.lora.adapterPath"),
        ("lora.rank", "spec.lora.rank"),
        ("lora.alpha", "spec.lora.alpha"),
        ("lora.dropout", "spec.lora.dropout"),
        ("lora.target_modules", "spec.lora.targetModules", "", "modules"),
        ("lora.exclude_modules", "spec.lora.excludeModules", "", "modules"),
        ("lora.adapter_path", "spec.lora.adapterPath"),
        ("use_shm", None, "the model is read from spec.model.path as it is (no copy to /dev/shm)"),
        ("enable_gradient_checkpointing", "spec.trainer.activationCheckpointing"),
    ]),
    *_names(VERL, "actor_rollout_ref.actor.", [
        ("optim.lr", "spec.optim.lr"),
        ("optim.lr_warmup_steps", "spec.optim.warmupSteps"),
        ("optim.warmup_style", "spec.optim.scheduler", "", "scheduler"),
        ("optim.lr_scheduler_type", "spec.optim.scheduler", "", "scheduler"),
        ("optim.weight_decay", "spec.optim.weightDecay"),
        ("optim.betas", "spec.optim.betas"),
        ("optim.clip_grad", "spec.optim.gradClip"),
        ("grad_clip", "spec.optim.gradClip"),
        ("ppo_mini_batch_size", "spec.training.miniBatchSize", _PROMPTS_NOT_SAMPLES, "prompts"),
        ("ppo_micro_batch_size_per_gpu", "spec.training.microBatchSize"),
        ("ppo_epochs", "spec.algorithm.ppoEpochs"),
        ("clip_ratio", "spec.algorithm.clipRatioLow", "set clipRatioLow and clipRatioHigh", "clip"),
        ("clip_ratio_low", "spec.algorithm.clipRatioLow"),
        ("clip_ratio_high", "spec.algorithm.clipRatioHigh"),
        ("clip_ratio_c", "spec.algorithm.dualClip"),
        ("loss_agg_mode", "spec.algorithm.lossAggregation"),
        ("entropy_coeff", "spec.algorithm.entropyCoef"),
        ("use_kl_loss", "spec.algorithm.kl.coef", _KL_ON, "kl_switch"),
        ("kl_loss_coef", "spec.algorithm.kl.coef"),
        ("kl_loss_type", "spec.algorithm.kl.estimator", "", "kl_estimator"),
        ("fsdp_config.reshard_after_forward", "spec.trainer.fsdp.reshardAfterForward"),
    ]),
    *_names(VERL, "actor_rollout_ref.rollout.", [
        ("n", "spec.algorithm.groupSize"),
        ("name", "spec.rollout.engine", "", "engine"),
        ("tensor_model_parallel_size", "spec.rollout.tensorParallelSize", "", "tp"),
        ("gpu_memory_utilization", "spec.rollout.memoryFraction"),
        ("temperature", "spec.rollout.sampling.temperature"),
        ("top_p", "spec.rollout.sampling.topP"),
        ("top_k", "spec.rollout.sampling.topK"),
        ("val_kwargs.n", "spec.training.eval.n"),
        ("val_kwargs.temperature", "spec.training.eval.temperature"),
        ("val_kwargs.top_p", "spec.training.eval.topP"),
    ]),
    *_names(VERL, "data.", [
        ("train_files", "spec.data.trainFiles", "", "list"),
        ("val_files", "spec.data.valFiles", "", "list"),
        ("prompt_key", "spec.data.promptKey"),
        ("max_prompt_length", "spec.data.maxPromptTokens", "longer prompts are dropped"),
        ("max_response_length", "spec.data.maxResponseTokens"),
        ("train_batch_size", "spec.training.promptsPerStep"),
        ("shuffle", "spec.data.shuffle"),
        ("seed", "spec.data.seed"),
    ]),
    *_names(VERL, "algorithm.", [
        ("adv_estimator", "spec.algorithm.name", "verl's gae is ppo, reinforce_plus_plus is "
         "reinforce_pp", "algorithm"),
        ("gamma", "spec.algorithm.gamma"),
        ("lam", "spec.algorithm.lam"),
        ("use_kl_in_reward", "spec.algorithm.kl.inReward"),
        ("kl_penalty", "spec.algorithm.kl.estimator", "", "kl_estimator"),
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
        ("path", "spec.reward.entrypoint", "path.py:name", "entrypoint"),
        ("name", "spec.reward.entrypoint", "path.py:name", "entrypoint"),
    ]),
    *_names(VERL, "trainer.", [
        ("total_training_steps", "spec.training.totalSteps"),
        ("total_epochs", "spec.training.epochs", _EPOCHS, "epochs"),
        ("save_freq", "spec.training.checkpointInterval"),
        ("test_freq", "spec.training.evalInterval"),
        ("val_before_train", "spec.training.evalBeforeTrain"),
        ("default_local_dir", "spec.training.outputDir"),
        ("max_actor_ckpt_to_keep", "spec.training.keepCheckpoints"),
        ("project_name", "spec.logging.wandb.project"),
        ("logger", "spec.logging.backends", "console is always on", "backends"),
        ("nnodes", "spec.trainer.replicas"),
        ("n_gpus_per_node", "spec.trainer.gpusPerReplica", "rollout GPUs are set apart: "
         "spec.rollout.gpusPerReplica", "gpus"),
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
        ("model.target_modules", "spec.critic.lora.targetModules", "", "list"),
        ("model.exclude_modules", "spec.critic.lora.excludeModules"),
    ]),
    *_names(SKYRL, "trainer.policy.", [
        ("model.path", "spec.model.path", "", "model"),
        ("model.lora.rank", "spec.lora.rank"),
        ("model.lora.alpha", "spec.lora.alpha"),
        ("model.lora.dropout", "spec.lora.dropout"),
        ("model.lora.target_modules", "spec.lora.targetModules", "", "list"),
        ("model.lora.exclude_modules", "spec.lora.excludeModules"),
        ("optimizer_config.lr", "spec.optim.lr"),
        ("optimizer_config.adam_betas", "spec.optim.betas"),
        ("optimizer_config.weight_decay", "spec.optim.weightDecay"),
        ("optimizer_config.max_grad_norm", "spec.optim.gradClip"),
        ("optimizer_config.num_warmup_steps", "spec.optim.warmupSteps"),
        ("optimizer_config.scheduler", "spec.optim.scheduler", "", "scheduler"),
        ("fsdp_config.reshard_after_forward", "spec.trainer.fsdp.reshardAfterForward"),
    ]),
    *_names(SKYRL, "trainer.", [
        ("train_batch_size", "spec.training.promptsPerStep"),
        ("policy_mini_batch_size", "spec.training.miniBatchSize", _PROMPTS_NOT_SAMPLES, "prompts"),
        ("micro_train_batch_size_per_gpu", "spec.training.microBatchSize"),
        ("update_epochs_per_batch", "spec.algorithm.ppoEpochs"),
        ("epochs", "spec.training.epochs", _EPOCHS, "epochs"),
        ("eval_interval", "spec.training.evalInterval"),
        ("eval_before_train", "spec.training.evalBeforeTrain"),
        ("ckpt_interval", "spec.training.checkpointInterval"),
        ("ckpt_path", "spec.training.outputDir"),
        ("export_path", "spec.training.outputDir"),
        ("max_ckpts_to_keep", "spec.training.keepCheckpoints"),
        ("max_prompt_length", "spec.data.maxPromptTokens", "longer prompts are dropped"),
        ("target_modules", "spec.lora.targetModules", "", "list"),
        ("seed", "spec.training.seed"),
        ("project_name", "spec.logging.wandb.project"),
        ("logger", "spec.logging.backends", "console is always on", "backends"),
        ("gradient_checkpointing", "spec.trainer.activationCheckpointing"),
        ("algorithm.advantage_estimator", "spec.algorithm.name", "SkyRL's gae is ppo", "algorithm"),
        ("algorithm.kl_loss_coef", "spec.algorithm.kl.coef"),
        ("algorithm.use_kl_loss", "spec.algorithm.kl.coef", _KL_ON, "kl_switch"),
        ("algorithm.use_kl_in_reward", "spec.algorithm.kl.inReward"),
        ("algorithm.eps_clip_low", "spec.algorithm.clipRatioLow"),
        ("algorithm.eps_clip_high", "spec.algorithm.clipRatioHigh"),
        ("algorithm.clip_ratio_c", "spec.algorithm.dualClip"),
        ("algorithm.loss_reduction", "spec.algorithm.lossAggregation", "", "loss_reduction"),
        ("algorithm.gamma", "spec.algorithm.gamma"),
        ("algorithm.lambd", "spec.algorithm.lam"),
        ("algorithm.value_clip", "spec.critic.valueClip"),
        ("critic.optimizer_config.lr", "spec.critic.optim.lr"),
        ("critic.model.lora.rank", "spec.critic.lora.rank"),
        ("critic.model.lora.alpha", "spec.critic.lora.alpha"),
        ("critic.model.lora.target_modules", "spec.critic.lora.targetModules", "", "list"),
    ]),
    *_names(SKYRL, "generator.", [
        ("n_samples_per_prompt", "spec.algorithm.groupSize"),
        ("backend", "spec.rollout.engine", "", "engine"),
        ("num_inference_engines", "spec.rollout.replicas"),
        ("inference_engine_tensor_parallel_size", "spec.rollout.tensorParallelSize", "", "tp"),
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
        ("train_data", "spec.data.trainFiles", "", "list"),
        ("val_data", "spec.data.valFiles", "", "list"),
    ]),
    *_names(RLINF, "runner.", [
        ("experiment_name", "spec.logging.runName",
         "also metadata.name, as a DNS name (unless --name)"),
        ("logger.project_name", "spec.logging.wandb.project"),
        ("logger.experiment_name", "spec.logging.runName"),
        ("task_type", None, "lorarl trains language models: reasoning only (no embodied tasks)"),
        ("logger.logger_backends", "spec.logging.backends", "", "backends"),
        ("max_epochs", "spec.training.epochs", _EPOCHS, "epochs"),
        ("max_steps", "spec.training.totalSteps", "", "steps"),
        ("val_check_interval", "spec.training.evalInterval"),
        ("save_interval", "spec.training.checkpointInterval"),
        ("seq_length", "spec.data.maxResponseTokens", "", "seq_length"),
        ("enable_dynamic_batch_size", None, "on when spec.training.maxTokensPerMicroBatch is set"),
        ("max_tokens_per_mbs", "spec.training.maxTokensPerMicroBatch",
         "with enable_dynamic_batch_size=True", "dynamic_bsz"),
        ("resume_dir", "spec.training.resume", "", "resume"),
        ("output_dir", "spec.training.outputDir"),
    ]),
    *_names(RLINF, "cluster.", [
        ("num_nodes", "spec.trainer.replicas"),
        ("component_placement.actor,rollout,reward", "spec.rollout.placement",
         "all: colocated", "placement"),
    ]),
    *_names(RLINF, "algorithm.", [
        ("adv_type", "spec.algorithm.name", "RLinf's gae is ppo, reinpp is reinforce_pp",
         "algorithm"),
        ("group_size", "spec.algorithm.groupSize"),
        ("n_minibatches", "spec.training.miniBatchSize", "", "minibatches"),
        ("training_batch_size_per_gpu", "spec.training.microBatchSize"),
        ("loss_agg_func", "spec.algorithm.lossAggregation"),
        ("kl_beta", "spec.algorithm.kl.coef"),
        ("kl_penalty_type", "spec.algorithm.kl.estimator", "", "kl_estimator"),
        ("ratio_clip_eps", "spec.algorithm.clipRatioLow", "set clipRatioLow and clipRatioHigh",
         "clip"),
        ("clip_ratio_low", "spec.algorithm.clipRatioLow"),
        ("clip_ratio_high", "spec.algorithm.clipRatioHigh"),
        ("clip_ratio_c", "spec.algorithm.dualClip"),
        ("entropy_bonus", "spec.algorithm.entropyCoef"),
        ("sampling_params.temperature", "spec.rollout.sampling.temperature"),
        ("sampling_params.top_p", "spec.rollout.sampling.topP"),
        ("sampling_params.top_k", "spec.rollout.sampling.topK", "", "top_k"),
        ("sampling_params.repetition_penalty", "spec.rollout.sampling.repetitionPenalty"),
        ("sampling_params.max_new_tokens", "spec.data.maxResponseTokens", "", "new_tokens"),
        ("sampling_params.do_sample", None, _SAMPLE),
        ("logprob_forward_micro_batch_size", None, _MICRO),
        ("val_rollout_batch_size_per_gpu", None, "evals send every validation prompt at once"),
    ]),
    *_names(RLINF, "rollout.", [
        ("model.model_path", "spec.model.path", "", "model"),
        ("rollout_backend", "spec.rollout.engine", "", "engine"),
        ("tensor_parallel_size", "spec.rollout.tensorParallelSize", "", "tp"),
        ("pipeline_parallel_size", None, _ENGINE_PP),
        ("gpu_memory_utilization", "spec.rollout.memoryFraction"),
        ("enforce_eager", None, _ENGINE_ARGS),
        ("max_running_requests", None, _ENGINE_ARGS),
        ("vllm.enable_chunked_prefill", None, _ENGINE_ARGS),
        ("vllm.enable_prefix_caching", None, _ENGINE_ARGS),
    ]),
    *_names(RLINF, "data.", [
        ("train_data_paths", "spec.data.trainFiles", "", "list"),
        ("val_data_paths", "spec.data.valFiles", "", "list"),
        ("prompt_key", "spec.data.promptKey"),
        ("answer_key", "spec.data.answerKey"),
        ("max_prompt_length", "spec.data.maxPromptTokens", "longer prompts are dropped"),
        ("rollout_batch_size", "spec.training.promptsPerStep"),
        ("shuffle", "spec.data.shuffle"),
        ("seed", "spec.data.seed"),
        ("type", None, "lorarl reads any dataset's prompt and answer columns "
         "(data.promptKey, data.answerKey)"),
        ("filter_prompt_by_length", None, "always on: prompts over maxPromptTokens are dropped"),
        ("num_workers", None, "lorarl's data loading has no worker count"),
    ]),
    *_names(RLINF, "actor.", [
        ("training_backend", None, "lorarl's trainer is FSDP2 only"),
        ("enable_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD),
        ("seed", "spec.training.seed"),
        ("model.model_path", "spec.model.path", "", "model"),
        ("model.is_lora", None, "lorarl always trains a LoRA adapter (spec.lora)"),
        ("model.lora_rank", "spec.lora.rank"),
        ("model.lora_path", "spec.lora.adapterPath"),
        ("optim.lr", "spec.optim.lr"),
        ("optim.adam_beta1", "spec.optim.betas", "with adam_beta2", "beta"),
        ("optim.adam_beta2", "spec.optim.betas", "with adam_beta1", "beta"),
        ("optim.weight_decay", "spec.optim.weightDecay"),
        ("optim.clip_grad", "spec.optim.gradClip"),
        ("lr_sched.lr_warmup_iters", "spec.optim.warmupSteps"),
        ("lr_sched.lr_decay_style", "spec.optim.scheduler", "", "scheduler"),
        ("fsdp_config.strategy", None, "lorarl's trainer is FSDP2 only"),
        ("fsdp_config.cpu_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD),
        ("fsdp_config.reshard_after_forward", "spec.trainer.fsdp.reshardAfterForward"),
        ("fsdp_config.use_liger_kernel", None, _KERNELS),
        ("tokenizer.trust_remote_code", "spec.model.trustRemoteCode"),
    ]),
    *_names(RLINF, "reward.", [
        ("reward_type", "spec.reward.function", "math: math_answer", "reward_type"),
        ("use_reward_model", None, "rewards are functions or a reward service "
         "(spec.reward.service), no reward model worker"),
    ]),
    *_names(RLINF, "critic.", [
        ("use_critic_model", None, "a critic is spec.critic, with algorithm ppo"),
    ]),
    # Settings lorarl needs none of, or has no equivalent for: `lorarl import` writes each as a
    # comment saying why, and docs/porting.md lists them.
    *_names(VERL, "actor_rollout_ref.", [
        ("hybrid_engine", None, _SEPARATE),
        ("model.use_remove_padding", None, _OWN_BATCHING),
        ("actor.use_dynamic_bsz", None, "on when spec.training.maxTokensPerMicroBatch is set"),
        ("actor.ppo_max_token_len_per_gpu", "spec.training.maxTokensPerMicroBatch",
         "with use_dynamic_bsz=True", "dynamic_bsz"),
        ("actor.fsdp_config.param_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD,
         "offload"),
        ("actor.fsdp_config.optimizer_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD,
         "offload"),
        ("actor.ulysses_sequence_parallel_size", None, _NO_SP),
        ("rollout.log_prob_micro_batch_size_per_gpu", None, _MICRO),
        ("rollout.load_format", None, _SYNC),
        ("rollout.layered_summon", None, _SYNC),
        ("rollout.enable_chunked_prefill", None, _ENGINE_ARGS),
        ("rollout.enforce_eager", None, _ENGINE_ARGS),
        ("rollout.free_cache_engine", None, _SEPARATE),
        ("rollout.max_num_batched_tokens", None, _ENGINE_ARGS),
        ("ref.log_prob_micro_batch_size_per_gpu", None, _REF),
        ("ref.fsdp_config.param_offload", None, _REF),
        # verl's Megatron backend (ppo_megatron_trainer)
        ("model.lora.type", None, "lorarl trains a LoRA adapter (no other adapter types)"),
        ("model.use_liger", None, _KERNELS),
        ("model.use_fused_kernels", None, _KERNELS),
        ("actor.strategy", None, _FSDP2),
        ("actor.megatron.use_mbridge", None, "lorarl loads Hugging Face weights as they are "
         "(no Megatron conversion)"),
        ("actor.megatron.tensor_model_parallel_size", None, _FSDP2),
        ("actor.megatron.pipeline_model_parallel_size", None, _FSDP2),
        ("actor.megatron.virtual_pipeline_model_parallel_size", None, _FSDP2),
        ("actor.megatron.expert_model_parallel_size", None, _FSDP2),
        ("actor.megatron.context_parallel_size", None, _NO_SP),
        ("actor.megatron.sequence_parallel", None, _NO_SP),
        ("actor.megatron.param_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD, "offload"),
        ("actor.megatron.grad_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD, "offload"),
        ("actor.megatron.optimizer_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD,
         "offload"),
        ("ref.megatron.tensor_model_parallel_size", None, _REF),
        ("ref.megatron.pipeline_model_parallel_size", None, _REF),
        ("ref.megatron.param_offload", None, _REF),
        # verl's multi-turn rollouts (SGLang agent loop; MATPO's jobs)
        ("rollout.mode", None, "lorarl's engines are always asynchronous servers"),
        ("rollout.do_sample", None, _SAMPLE),
        ("rollout.val_kwargs.do_sample", None, _SAMPLE),
        ("rollout.multi_turn.enable", "spec.environment.entrypoint", "the tool_calling "
         "environment", "multi_turn"),
        ("rollout.multi_turn.max_assistant_turns", "spec.environment.maxTurns", "",
         "environment"),
        ("rollout.multi_turn.max_parallel_calls", "spec.environment.params",
         "tool_calling's max_calls_per_turn", "env_param"),
        ("rollout.multi_turn.max_tool_response_length", "spec.environment.params",
         "tool_calling's max_response_chars", "env_param"),
        ("rollout.multi_turn.max_user_turns", None, "the environment ends an episode; "
         "environment.maxTurns counts the model's turns"),
        ("rollout.multi_turn.format", None, "tool_calling reads Hermes-style <tool_call> tags "
         "(its only format)"),
        ("rollout.multi_turn.tool_config_path", None, _TOOLS),
        ("rollout.multi_turn.enable_tokenization_sanity_check", None, "a verl debugging check"),
        ("rollout.multi_turn.enable_final_summary", None, _MATPO),
        ("rollout.multi_turn.disable_final_summary_for_main_agent", None, _MATPO),
        ("rollout.multi_turn.max_summary_length", None, _MATPO),
        ("rollout.multi_turn.delete_think_from_subagent_tools", None, _MATPO),
    ]),
    *_names(VERL, "data.", [
        ("filter_overlong_prompts", None, "always on: prompts over maxPromptTokens are dropped"),
        ("truncation", None, "prompts over maxPromptTokens are dropped, never cut"),
        ("val_batch_size", None, "evals send every validation prompt at once"),
        ("return_raw_chat", None, "episodes always start from the prompt's chat messages"),
    ]),
    *_names(VERL, "trainer.", [
        ("experiment_name", "spec.logging.runName",
         "also metadata.name, as a DNS name (unless --name)"),
        ("device", None, "pods get GPUs from trainer.gpusPerReplica"),
        ("resume_mode", "spec.training.resume", "", "resume"),
        ("rollout_data_dir", "spec.training.samplesInterval", "", "dump"),
        ("validation_data_dir", None, "every eval's completions are kept in "
         "outputDir/evals/step-N.jsonl"),
    ]),
    *_names(VERL, "custom_reward_function.", [
        ("reward_kwargs", "spec.reward.params"),
    ]),
    *_names(SKYRL, "trainer.", [
        ("strategy", None, "lorarl's trainer is FSDP2 only"),
        ("placement.colocate_all", "spec.rollout.placement", "true: colocated", "colocate"),
        ("placement.policy_num_nodes", "spec.trainer.replicas"),
        ("placement.policy_num_gpus_per_node", "spec.trainer.gpusPerReplica"),
        ("placement.ref_num_nodes", None, _REF),
        ("placement.ref_num_gpus_per_node", None, _REF),
        ("placement.critic_num_gpus_per_node", None, "the critic shares the trainer's GPUs"),
        ("policy.fsdp_config.cpu_offload", "spec.trainer.fsdp.offloadParams", _OFFLOAD),
        ("ref.fsdp_config.cpu_offload", None, _REF),
        ("use_sample_packing", None, _OWN_BATCHING),
        ("eval_batch_size", None, "evals send every validation prompt at once"),
        ("run_name", "spec.logging.runName",
         "also metadata.name, as a DNS name (unless --name)"),
        ("resume_mode", "spec.training.resume", "", "resume"),
        ("micro_forward_batch_size_per_gpu", None, _MICRO),
    ]),
    *_names(SKYRL, "generator.", [
        ("weight_sync_backend", None, _SYNC),
        ("async_engine", None, "lorarl's engines are always asynchronous servers"),
        ("batched", None, "lorarl sends each prompt's samples as they are ready"),
        ("run_engines_locally", None, _SEPARATE),
        ("enable_prefix_caching", None, _ENGINE_ARGS),
        ("enable_chunked_prefill", None, _ENGINE_ARGS),
        ("max_num_batched_tokens", None, _ENGINE_ARGS),
        ("max_num_seqs", None, _ENGINE_ARGS),
        ("use_conversation_multi_turn", None, "multi-turn is spec.environment"),
    ]),
    *_names(SKYRL, "environment.", [
        ("env_class", "spec.reward.function", "gsm8k's scorer is reward.function gsm8k",
         "env_class"),
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
