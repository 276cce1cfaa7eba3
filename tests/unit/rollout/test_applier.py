"""UpdateApplier against a recording engine: the unit under test is the applier, so the engine only
records what reached it. Expected merged weights are computed here from the checkpoint file, not
with lorarl's merge code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import linear_modules, make_tiny_model
from lorarl.rollout.applier import UpdateApplier
from lorarl.rollout.engine import EngineError, RolloutEngine
from lorarl.sync.buckets import SyncHeader, pack, unpack_all
from lorarl.sync.errors import UpdateValidationError

RANK, ALPHA = 4, 8.0
SCALING = ALPHA / RANK
LAYERS = range(2)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecordingEngine(RolloutEngine):
    """Records every call; `refuse` makes the next operations fail like a real engine error."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.loads: list[tuple[str, int, dict[str, torch.Tensor]]] = []
        self.unloads: list[str] = []
        self.refuse = False
        self._version: int | None = None

    @property
    def weight_version(self) -> int | None:
        return self._version

    def close(self) -> None:
        pass  # nothing to release: no connections

    def health(self) -> bool:
        return True

    def push_merged_weights(self, named_tensors, version: int) -> None:
        named = {n: t.clone() for n, t in named_tensors}
        if self.refuse:
            raise EngineError(f"reload_weights v{version} failed: engine says no")
        self.pushes.append((version, named))
        self._version = version

    def load_adapter(self, adapter_dir, name: str, version: int) -> None:
        if self.refuse:
            raise EngineError(f"load adapter {name!r}: engine says no")
        files = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
        self.loads.append((name, version, files))
        self._version = version

    def unload_adapter(self, name: str) -> None:
        self.unloads.append(name)

    def flush_cache(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def base(model_dir) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def modules_for(leaves) -> list[str]:
    return linear_modules(leaves, LAYERS)


def lora_tensors(base, modules, seed, rank=RANK) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        out_f, in_f = base[f"{m}.weight"].shape
        out[f"base_model.model.{m}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.1
        out[f"base_model.model.{m}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.1
    return out


def update(version, tensors, modules, mode="merged", rank=RANK):
    """What a receiver hands the applier: the header with bucket specs, tensors from the buffers."""
    header = SyncHeader(
        version=version,
        mode=mode,
        scaling=ALPHA / rank,
        rank=rank,
        alpha=ALPHA,
        target_modules=tuple(modules),
    )
    buckets = pack(tensors, 64 * 1024)
    header = header.with_buckets(buckets)
    return header, unpack_all([b.buffer for b in buckets], header, copy=True)


def expected_merged(base, tensors, module, dtype) -> torch.Tensor:
    a = tensors[f"base_model.model.{module}.lora_A.weight"].float()
    b = tensors[f"base_model.model.{module}.lora_B.weight"].float()
    return (base[f"{module}.weight"].float() + (b @ a) * SCALING).to(dtype)


def make_applier(model_dir, tmp_path, mode="merged", dtype="float32"):
    engine = RecordingEngine()
    applier = UpdateApplier(
        engine,
        model_dir,
        mode,
        expected_rank=RANK,
        engine_dtype=dtype,
        adapter_root=tmp_path / "adapters",
    )
    return engine, applier


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_pushes_base_plus_scaled_delta_for_every_module(model_dir, base, tmp_path, dtype):
    engine, applier = make_applier(model_dir, tmp_path, dtype=dtype)
    modules = modules_for(ALL_LINEAR)
    tensors = lora_tensors(base, modules, seed=1)
    applier.apply(*update(1, tensors, modules))
    ((version, pushed),) = engine.pushes
    assert version == 1
    assert sorted(pushed) == sorted(f"{m}.weight" for m in modules)
    want_dtype = getattr(torch, dtype)
    for m in modules:
        got = pushed[f"{m}.weight"]
        assert got.dtype == want_dtype
        assert torch.equal(got, expected_merged(base, tensors, m, want_dtype)), m
        assert not torch.equal(got, base[f"{m}.weight"].to(want_dtype)), f"{m}: delta lost"


def test_untargeted_fused_siblings_are_sent_unchanged(model_dir, base, tmp_path):
    engine, applier = make_applier(model_dir, tmp_path)
    modules = modules_for(["q_proj", "gate_proj"])
    tensors = lora_tensors(base, modules, seed=2)
    applier.apply(*update(1, tensors, modules))
    ((_, pushed),) = engine.pushes
    siblings = modules_for(["k_proj", "v_proj", "up_proj"])
    assert sorted(pushed) == sorted(f"{m}.weight" for m in modules + siblings)
    for m in siblings:
        assert torch.equal(pushed[f"{m}.weight"], base[f"{m}.weight"]), m
    for m in modules:
        assert torch.equal(pushed[f"{m}.weight"], expected_merged(base, tensors, m, torch.float32))


def test_successive_versions_merge_from_pristine_base(model_dir, base, tmp_path):
    engine, applier = make_applier(model_dir, tmp_path, dtype="bfloat16")
    modules = modules_for(["q_proj", "down_proj"])
    for version in range(1, 6):
        tensors = lora_tensors(base, modules, seed=100 + version)
        applier.apply(*update(version, tensors, modules))
        got_version, pushed = engine.pushes[-1]
        assert got_version == version and applier.current.header.version == version
        for m in modules:
            want = expected_merged(base, tensors, m, torch.bfloat16)
            assert torch.equal(pushed[f"{m}.weight"], want), f"v{version} {m} drifted"
    assert len(engine.pushes) == 5


def test_adapter_mode_writes_a_peft_folder_and_swaps_versions(model_dir, base, tmp_path):
    engine, applier = make_applier(model_dir, tmp_path, mode="adapter")
    modules = modules_for(ALL_LINEAR)
    v1 = lora_tensors(base, modules, seed=3)
    applier.apply(*update(1, v1, modules, mode="adapter"))
    folder = tmp_path / "adapters" / "lorarl-v1"
    assert [(n, v) for n, v, _ in engine.loads] == [("lorarl-v1", 1)]
    assert engine.unloads == [] and engine.pushes == []

    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(folder)
    )
    assert peft.peft_config["default"].r == RANK
    assert peft.peft_config["default"].lora_alpha == ALPHA
    loaded = get_peft_model_state_dict(peft)
    assert sorted(loaded) == sorted(v1)
    for name, t in v1.items():
        assert torch.equal(loaded[name], t), name

    v2 = lora_tensors(base, modules, seed=4)
    applier.apply(*update(2, v2, modules, mode="adapter"))
    assert [(n, v) for n, v, _ in engine.loads] == [("lorarl-v1", 1), ("lorarl-v2", 2)]
    assert engine.unloads == ["lorarl-v1"]
    assert not folder.exists(), "the unloaded version's folder is left behind"
    for name, t in v2.items():
        assert torch.equal(engine.loads[-1][2][name], t), name


def _bad_updates(base):
    modules = modules_for(["q_proj", "v_proj"])
    good = lora_tensors(base, modules, seed=9)
    wrong_shape = dict(good)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    wrong_shape[name] = torch.zeros(RANK, 129)
    unknown = {
        **good,
        **lora_tensors(
            {"model.layers.0.self_attn.foo_proj.weight": torch.zeros(64, 128)},
            ["model.layers.0.self_attn.foo_proj"],
            seed=1,
        ),
    }
    low_rank = lora_tensors(base, modules, seed=9, rank=2)
    return {
        "shape": (
            update(9, wrong_shape, modules),
            ["layers.1.self_attn.v_proj", "[4, 129]", "[4, 128]"],
        ),
        "unknown module": (
            update(9, unknown, [*modules, "model.layers.0.self_attn.foo_proj"]),
            ["foo_proj", "not in the base model"],
        ),
        "rank": (update(9, low_rank, modules, rank=2), ["rank 2", "expected rank 4"]),
        "mode": (update(9, good, modules, mode="adapter"), ["'adapter' mode", "'merged'"]),
    }


@pytest.mark.parametrize("case", ["shape", "unknown module", "rank", "mode"])
def test_bad_update_reaches_nothing_and_keeps_last_good(model_dir, base, tmp_path, case):
    engine, applier = make_applier(model_dir, tmp_path)
    modules = modules_for(["q_proj", "v_proj"])
    good = lora_tensors(base, modules, seed=5)
    applier.apply(*update(1, good, modules))
    (header, tensors), words = _bad_updates(base)[case]
    error = UpdateValidationError if case != "mode" else ValueError
    with pytest.raises(error) as info:
        applier.apply(header, tensors)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"
    assert len(engine.pushes) == 1, "a rejected update reached the engine"
    assert applier.current.header.version == 1

    replayed = applier.reapply()
    assert replayed.header.version == 1
    version, pushed = engine.pushes[-1]
    assert version == 1 and len(engine.pushes) == 2
    for m in modules:
        assert torch.equal(pushed[f"{m}.weight"], expected_merged(base, good, m, torch.float32))


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_engine_refusal_keeps_previous_version_current(model_dir, base, tmp_path, mode):
    engine, applier = make_applier(model_dir, tmp_path, mode=mode)
    modules = modules_for(["q_proj", "k_proj", "v_proj"])
    good = lora_tensors(base, modules, seed=6)
    applier.apply(*update(1, good, modules, mode=mode))
    engine.refuse = True
    with pytest.raises(EngineError, match="engine says no"):
        applier.apply(*update(2, lora_tensors(base, modules, seed=7), modules, mode=mode))
    assert applier.current.header.version == 1
    assert engine.weight_version == 1
    engine.refuse = False
    assert applier.reapply().header.version == 1
    if mode == "merged":
        version, pushed = engine.pushes[-1]
        assert version == 1 and len(engine.pushes) == 2
        for m in modules:
            assert torch.equal(pushed[f"{m}.weight"], expected_merged(base, good, m, torch.float32))
    else:
        name, version, files = engine.loads[-1]
        assert (name, version, len(engine.loads)) == ("lorarl-v1", 1, 2)
        assert all(torch.equal(files[n], t) for n, t in good.items())
        assert "lorarl-v1" not in engine.unloads


def test_reapply_before_any_update_is_a_no_op(model_dir, tmp_path):
    engine, applier = make_applier(model_dir, tmp_path)
    assert applier.reapply() is None
    assert engine.pushes == [] and engine.loads == []
