"""bench.mismatch's own arithmetic: the update size it draws and the figures it reports.

The measurement itself needs two vLLM servers per model (minutes), so it runs in `make bench`,
not here."""

from __future__ import annotations

import pytest
import torch
from bench.mismatch import gap_stats, set_delta, summary, update_stats
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import tiny_config
from lorarl.trainer.model.loading import LoraSettings, apply_lora


@pytest.mark.parametrize("delta", [1e-3, 1e-2])
def test_set_delta_makes_the_update_that_fraction_of_every_weight(delta):
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(tiny_config("llama")), LoraSettings(rank=4))
    set_delta(model, delta, torch.Generator().manual_seed(1))
    seen = 0
    for module in model.modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            update = module.scaling["default"] * (b @ a)
            ratio = (update.norm() / module.base_layer.weight.norm()).item()
            assert ratio == pytest.approx(delta, rel=1e-4)
            seen += 1
    assert seen == 14  # 2 layers x all-linear


def test_update_stats_tell_a_delivered_update_from_a_lost_or_halved_one():
    t0 = [[-1.0, -2.0, -0.5]]
    t1 = [[-0.9, -2.2, -0.4]]
    exact = update_stats(t0, t1, t0, t1)
    assert exact["survives"] == pytest.approx(1) and exact["error"] == pytest.approx(0)
    lost = update_stats(t0, t0, t0, t1)
    assert lost["survives"] == pytest.approx(0) and lost["error"] == pytest.approx(1)
    half = [[(a + b) / 2 for a, b in zip(t0[0], t1[0], strict=True)]]
    halved = update_stats(t0, half, t0, t1)
    assert halved["survives"] == pytest.approx(0.5) and halved["corr"] == pytest.approx(1)


def test_gap_stats_and_summary_rows():
    stats = gap_stats([[0.0] * 100], [torch.arange(100, dtype=torch.float32) / -100])
    assert stats["tokens"] == 100 and stats["max"] == pytest.approx(0.99)
    assert stats["p50"] == pytest.approx(0.495) and stats["mean"] == pytest.approx(0.495)
    mode = {"mismatch": stats, "update": {"survives": 0.9, "error": 0.2, "corr": 0.95},
            "tokens_per_s": 10.0}  # fmt: skip
    results = {"m": {"base": {"mismatch": stats, "tokens_per_s": {"merged_server": 20.0}},
                     "deltas": {"0.01": {"merged": mode, "adapter": mode}}}}  # fmt: skip
    rows = summary(results)
    assert [(r["delta"], r["mode"]) for r in rows] == [
        (0, "base (no update)"), (0.01, "merged"), (0.01, "adapter"),
    ]  # fmt: skip
    assert rows[1]["update_survives"] == 0.9 and rows[0]["tokens_per_s"] == 20.0
