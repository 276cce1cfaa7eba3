"""TRL's side of bench.vs_trl, in its own process: GRPOTrainer + peft LoraConfig on a Workload.

    python -m bench.trl_child WORKLOAD_JSON MODEL_DIR DATA_JSONL OUT_DIR [CONFIG_JSON]

(bench.vs_trl runs it). CONFIG_JSON: GRPOConfig fields set on top of TRL's defaults (the
variant's; none for the library-defaults row).

Writes OUT_DIR/trl_stats.json (a vs_trl.RunStats). Timing: a TrainerCallback takes the wall time
from `on_step_begin` to `on_step_end` (one optimizer step: generation, scoring, every
micro-batch's forward/backward, the optimizer); the parts come from TRL's own profiling contexts
(`transformers.generate`, `_calculate_rewards`, `_prepare_inputs`, `compute_loss`), which TRL
only forwards to wandb/mlflow/trackio: wrapping `ProfilingContext._log_metrics` captures them.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.vs_trl import RunStats, Workload


def trl_child(
    w: Workload, model: Path, data: Path, out_dir: Path, overrides: dict[str, Any] | None = None
) -> None:
    """Runs inside the child: builds TRL's trainer for `w` and writes its RunStats as JSON."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from lorarl.rewards import get_reward
    from lorarl.trainer.telemetry.cpu_util import read_cpu_times, utilisation

    timings: list[tuple[str, float]] = []
    original = profiling.ProfilingContext._log_metrics

    def capture(self, duration: float) -> None:
        timings.append((self.name.split(".", 1)[-1], duration))
        original(self, duration)

    profiling.ProfilingContext._log_metrics = capture

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    # Conversational prompts: TRL applies the chat template, as lorarl does for a tokenizer
    # that has one; every other column reaches the reward as metadata, as in lorarl.
    dataset = Dataset.from_list(
        [{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]
    )
    scorer = get_reward(w.reward, **w.reward_params)

    meta_keys = [k for k in rows[0] if k not in ("prompt", "answer")]

    def reward_fn(prompts, completions, answer, **columns) -> list[float]:
        out = []
        for i, (c, a) in enumerate(zip(completions, answer, strict=True)):
            text = c[-1]["content"] if isinstance(c, list) else c
            meta = {k: columns[k][i] for k in meta_keys}
            out.append(_score(scorer(prompts[i], text, a, meta)))
        return out

    reward_fn.__name__ = w.reward
    stats = RunStats("trl", 0)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timings.clear()
            self.t0 = time.perf_counter()
            self.cpu0 = read_cpu_times()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - self.t0
            total = {}
            for name, d in timings:
                total[name] = total.get(name, 0.0) + d
            prepare = total.get("_prepare_inputs", 0.0)
            stats.step_s.append(step)
            stats.generate_s.append(total.get("transformers.generate", 0.0))
            stats.reward_s.append(total.get("_calculate_rewards", 0.0))
            stats.update_s.append(step - prepare)
            stats.cpu_util.append(utilisation(self.cpu0, read_cpu_times()))
            stats.extra.setdefault("prepare_inputs_s", []).append(prepare)
            stats.extra.setdefault("compute_loss_s", []).append(total.get("compute_loss", 0.0))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                stats.reward_mean.append(float(logs["reward"]))
                stats.completion_len.append(float(logs.get("completions/mean_length", 0.0)))

    config = GRPOConfig(
        output_dir=str(out_dir / "trl_out"),
        max_steps=w.steps,
        per_device_train_batch_size=w.micro_batch_size,
        gradient_accumulation_steps=w.samples_per_step // w.micro_batch_size,
        num_generations=w.group_size,
        max_completion_length=w.max_completion_tokens,
        temperature=w.temperature,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        shuffle_dataset=False,
        use_cpu=True,  # what TRL picks anyway on a machine without a GPU
        seed=w.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **(overrides or {}),
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=[reward_fn],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=w.rank, lora_alpha=w.alpha, target_modules="all-linear"),
        callbacks=[StepTimer()],
    )
    trainer.train()
    stats.extra["torch_threads"] = torch.get_num_threads()
    stats.extra["config"] = {
        "bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing
    }  # fmt: skip
    (out_dir / "trl_stats.json").write_text(json.dumps(asdict(stats)))


def _score(value: Any) -> float:
    return float(getattr(value, "score", value))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (4, 5):
        raise SystemExit(
            "usage: python -m bench.trl_child WORKLOAD_JSON MODEL DATA OUT_DIR [CONFIG_JSON]"
        )
    overrides = json.loads(argv[4]) if len(argv) == 5 else {}
    trl_child(
        Workload(**json.loads(argv[0])), Path(argv[1]), Path(argv[2]), Path(argv[3]), overrides
    )


if __name__ == "__main__":
    main()
