"""The memory plan (plan/memory.py): its parts on a hand-computed config, its monotonicity, the
`lorarl plan --memory` output, `lorarl validate`'s warning and refusal, and the estimate against
a measured update on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from bench.common import LIVE_TENSORS_MALLOC
from click.testing import CliRunner

from lorarl.cli.main import main
from lorarl.local.tiny import make_tiny_model
from lorarl.plan import memory as mem
from lorarl.plan.memory import GIB, MIB, ModelShape, Settings

ROOT = Path(__file__).resolve().parents[3]

# A small hand-checkable model: 2 layers, hidden 8, 2 heads of 4 (1 kv head), MLP 16.
SHAPE = ModelShape(
    hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10,
    params=1000, layer_params=300, lora_params=100, lora_ranks_per_layer=4,
)  # fmt: skip
SETTINGS = Settings(
    world=2, gpu=True, weight_bytes=2, compute_bytes=2, rows=2, seq=5, response=3,
    checkpointing=False, offload=False, tensor_parallel=1, engine_gpu=True, memory_fraction=0.5,
    kv_cache_bytes=0, colocated=False,
)  # fmt: skip
# Qwen2.5-0.5B's published config: large enough vocab and layers to exercise every term.
QWEN_05B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
}  # fmt: skip


def test_activations_per_layer_and_token_by_hand():
    # compute dtype (2 B): 2 norm outputs (2x8) + q_rot, attention out, o_proj in (3x8)
    # + k_rot, v (2x4) + MLP (4x16) + LoRA A outputs (4) = 116 elements; + 2 fp32 norm inputs
    assert mem.activation_bytes_per_layer_token(SHAPE, 2) == 2 * 116 + 2 * 4 * 8


def test_trainer_parts_by_hand():
    t = mem.trainer_memory(SHAPE, SETTINGS)
    assert t.base_weights == 1000 * 2 // 2  # bf16, over 2 ranks
    assert t.lora_params == t.lora_grads == 4 * 100 // 2  # fp32, sharded
    assert t.optimizer == 2 * 4 * 100 // 2  # AdamW's two fp32 moments
    assert t.gathered_units == (400 + 2 * 300) * 2  # root + two layers, bf16
    # 10 tokens: 2 layers x 296 B x 10 + the final norm (fp32 input, bf16 output: 8 x 6 B)
    assert t.activations_full == 2 * 2960 + 10 * 8 * 6
    # checkpointed: each layer's input (8 x 2 B) + one layer recomputed in the backward
    assert t.activations_checkpointed == 2 * 10 * 8 * 2 + 2960 + 10 * 8 * 6
    # logits of 2 x (3 + 1) positions and their gradient in bf16 + 3 fp32 chunk temporaries
    assert t.logits == 2 * 8 * 10 * 2 + 3 * 8 * 10 * 4
    assert t.peak == t.resident + t.update_transient
    assert t.resident == 1000 + 200 + 400


def test_engine_parts_by_hand():
    e = mem.engine_memory(SHAPE, replace(SETTINGS, tensor_parallel=2), 4000)
    assert e.weights == 1000 * 2 // 2  # bf16 over 2 tensor-parallel ranks
    assert e.budget == 2000 and e.kv_cache == 1000  # memoryFraction 0.5 of 4000 B
    # k and v, 2 layers, 1 kv head (replicated over the 2 ranks) x 4 dims, bf16
    assert e.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    cpu = mem.engine_memory(SHAPE, replace(SETTINGS, engine_gpu=False, kv_cache_bytes=GIB), 1000)
    assert cpu.kv_cache == GIB and cpu.kv_tokens == GIB // 32
    assert e.kv_tokens == 1000 // 32


def test_checkpointing_ranks_and_offload_move_memory_the_right_way():
    big = replace(SETTINGS, rows=4, seq=2048, response=1024)
    full = mem.trainer_memory(SHAPE, big)
    ckpt = mem.trainer_memory(SHAPE, replace(big, checkpointing=True))
    assert ckpt.activations < full.activations
    assert ckpt.activations == full.activations_checkpointed
    more = mem.trainer_memory(SHAPE, replace(big, world=8))
    assert more.base_weights < full.base_weights and more.optimizer < full.optimizer
    off = mem.trainer_memory(SHAPE, replace(big, offload=True))
    assert off.base_weights == off.lora_params == off.optimizer == 0
    assert off.host_offloaded == full.base_weights + 2 * full.lora_params + full.optimizer
    assert off.peak < full.peak
    fewer = mem.trainer_memory(SHAPE, replace(big, rows=1))
    assert fewer.activations < full.activations and fewer.logits < full.logits


def test_model_shape_counts_the_model_and_its_adapter_from_the_config():
    from lorarl.model_checks import model_shape
    from lorarl.trainer.model.loading import LoraSettings

    shape = model_shape(QWEN_05B, LoraSettings(rank=32, alpha=64.0))
    assert shape.params == 494_032_768  # Qwen2.5-0.5B's published count (tied embeddings)
    h, kv, i, r = 896, 128, 4864, 32
    per_layer = r * (h + h) + 2 * r * (h + kv) + r * (h + h) + 2 * r * (h + i) + r * (i + h)
    assert shape.lora_params == 24 * per_layer
    assert shape.lora_ranks_per_layer == 7 * r
    assert shape.root_params == 151936 * 896 + 896  # embeddings (tied head) + final norm
    ppo = model_shape(QWEN_05B, LoraSettings(rank=32, alpha=64.0), critic_rank=16)
    assert ppo.critic_params == shape.lora_params // 2 + 896 + 1  # half-rank adapter + value head


def _job(tmp_path: Path, config: dict, training: dict | None = None, **trainer) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    doc = yaml.safe_load((ROOT / "examples" / "qwen2.5-3b-gsm8k.yaml").read_text())
    doc["spec"]["model"] = {"path": str(model), "dtype": "bfloat16"}
    doc["spec"]["trainer"].update(trainer)
    doc["spec"]["training"].update(training or {})
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_plan_memory_prints_the_plan_and_json(tmp_path: Path):
    f = _job(tmp_path, QWEN_05B)
    r = CliRunner().invoke(main, ["plan", "--memory", str(f)])
    assert r.exit_code == 0, r.output
    assert "memory plan (GPU size 80 GiB" in r.output
    for part in ("base weights (sharded)", "AdamW state", "activations (checkpointed)",
                 "logits + grad", "KV cache", "without checkpointing"):  # fmt: skip
        assert part in r.output
    r = CliRunner().invoke(main, ["plan", "--memory", "-o", "json", str(f)])
    data = json.loads(r.output)
    t = data["trainerPerGpuGiB"]
    assert t["activations_checkpointed"] < t["activations_full"]
    assert data["assumptions"]["trainerRanks"] == 16
    # the pod plan is unchanged without --memory
    assert "memory plan" not in CliRunner().invoke(main, ["plan", str(f)]).output


def test_validate_warns_over_the_gpu_and_refuses_what_cannot_fit(tmp_path: Path):
    f = _job(tmp_path, QWEN_05B)
    r = CliRunner().invoke(main, ["validate", "--local", str(f)])
    assert r.exit_code == 0 and "memory" not in r.output  # no memory check unless asked
    r = CliRunner().invoke(main, ["validate", "--local", "--gpu-memory", "80GiB", str(f)])
    assert r.exit_code == 0 and "warning" not in r.output, r.output
    r = CliRunner().invoke(main, ["validate", "--local", "--gpu-memory", "2GiB", str(f)])
    assert r.exit_code == 0, r.output
    assert "warning: memory: trainer: an update peaks" in r.output
    assert "trainer.fsdp.offloadParams" in r.output
    r = CliRunner().invoke(main, ["validate", "--local", "--gpu-memory", "200MiB", str(f)])
    assert r.exit_code == 1
    assert "memory: engine: the weights alone" in r.output
    r = CliRunner().invoke(main, ["validate", "--local", "--gpu-memory", "eighty", str(f)])
    assert r.exit_code == 2 and "--gpu-memory" in r.output


def test_offload_in_the_spec_moves_the_base_off_the_gpu(tmp_path: Path):
    f = _job(tmp_path, QWEN_05B, fsdp={"offloadParams": True})
    data = json.loads(CliRunner().invoke(main, ["plan", "--memory", "-o", "json", str(f)]).output)
    t = data["trainerPerGpuGiB"]
    assert t["base_weights"] == 0 and t["host_offloaded"] > 0


def test_the_token_budget_sets_the_largest_micro_batch(tmp_path: Path):
    # maxPromptTokens 512 + maxResponseTokens 1024: a 3072-token budget packs 2 full rows
    f = _job(tmp_path, QWEN_05B, training={"maxTokensPerMicroBatch": 3072})
    data = json.loads(CliRunner().invoke(main, ["plan", "--memory", "-o", "json", str(f)]).output)
    assert data["assumptions"]["microBatch"] == {"rows": 2, "tokens": 3072}
    f = _job(tmp_path, QWEN_05B, training={"maxTokensPerMicroBatch": 100})  # one runs alone
    data = json.loads(CliRunner().invoke(main, ["plan", "--memory", "-o", "json", str(f)]).output)
    assert data["assumptions"]["microBatch"] == {"rows": 1, "tokens": 1536}


def test_a_colocated_engine_must_fit_beside_the_trainers_resident_state():
    t = mem.trainer_memory(SHAPE, SETTINGS)
    gpu = t.peak + 1  # the update alone fits
    alone = mem.estimate(SHAPE, SETTINGS, gpu)
    assert alone.problems == [] and alone.impossible == []
    shared = mem.estimate(SHAPE, replace(SETTINGS, colocated=True, memory_fraction=0.99), gpu)
    assert [p.split(":")[0] for p in shared.problems] == ["colocated"]
    small = mem.estimate(SHAPE, SETTINGS, t.peak - 1)
    assert small.problems and small.problems[0].startswith("trainer: an update peaks")
    assert small.impossible == []  # offload + checkpointing + one row would fit
    least = mem.trainer_memory(SHAPE, replace(SETTINGS, offload=True, checkpointing=True, rows=1))
    none = mem.estimate(SHAPE, SETTINGS, least.peak - 1)
    assert any(p.startswith("trainer: even with") for p in none.impossible)


def test_parse_size():
    assert mem.parse_size("80GiB") == 80 * GIB
    assert mem.parse_size("80G") == 80 * GIB
    assert mem.parse_size("141GB") == 141 * 10**9
    assert mem.parse_size("512MiB") == 512 * MIB
    with pytest.raises(ValueError):
        mem.parse_size("lots")


def test_chunk_rows_match_the_trainer():
    from lorarl.trainer.model.logprobs import CHUNK_ROWS

    assert mem.CHUNK_ROWS == CHUNK_ROWS


# The estimate models live tensors; with glibc's mmap threshold fixed at 64 KiB every tensor over
# it is its own mapping, returned when freed, so the peak-RSS delta follows the live tensors
# (bench/memory_plan.py; with glibc's default the heap keeps freed activations too and RSS runs
# up to ~2x the live peak: bench/results/memory_plan.json). Tolerance: +-15%.
UPDATE_RATIO = (0.85, 1.15)


def test_estimate_tracks_a_measured_update_on_the_tiny_model(tmp_path):
    # the quickstart model's shape, untaught: memory does not depend on the weights' values
    tiny = make_tiny_model(tmp_path / "tiny", "llama", seed=0, init_std=0.1)
    code = (
        "import json, torch; torch.set_num_threads(1); from pathlib import Path; "
        "from bench.memory_plan import measure; "
        f"print(json.dumps(measure(Path({str(tiny)!r}), 8, 512, False)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
             **LIVE_TENSORS_MALLOC},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    from bench.memory_plan import estimate

    est = estimate(tiny, 8, 512, False)
    ratio = est["update_mib"] / measured["update_mib"]
    assert UPDATE_RATIO[0] <= ratio <= UPDATE_RATIO[1], (est, measured)
