"""Merged sync merged at the edge (issue 36 #3): only the adapter reaches vLLM, its worker merges.

Against a real vLLM CPU server on the tiny Llama (fp32): after `push_adapter_merge`, the weights
the engine computes with (read back through the identity GEMM of the worker extension) equal
PEFT's own `merge_and_unload` for every targeted module, a second version replaces the first
(merged from the pristine copy, nothing accumulates), untargeted fused siblings keep the
checkpoint, and the sidecar's applier serves the same bits whichever side merges.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lorarl.rollout.applier import UpdateApplier
from lorarl.rollout.engine import EngineError
from lorarl.rollout.vllm_engine import VLLMEngine
from lorarl.sync.buckets import SyncHeader, pack
from lorarl.sync.names import group_lora_pairs
from tests.integration import test_vllm_engine as engine_tests
from tests.integration.test_vllm_engine import (
    MODEL_NAME,
    PROJ,
    complete,
    hf_model,
    read_back,
    reference_logprobs,
)

# The same module-scoped server (tiny Llama, fp32, worker extension on) as test_vllm_engine.
server = engine_tests.server
base_weights = engine_tests.base_weights

ALL = [f"model.layers.{i}.{p}.weight" for i in (0, 1) for p in PROJ]
SCALING = 2.0  # alpha 16 / r 8


def peft_adapter(server, out: Path, seed: int, targets: list[str]):
    """A saved PEFT LoRA (B non-zero) and PEFT's own fp32 merge of it, keyed by HF name."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=targets)
    model = get_peft_model(hf_model(server), cfg)
    model.save_pretrained(out)
    merged = {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}
    return load_file(str(out / "adapter_model.safetensors")), merged


def test_merge_in_falls_back_to_the_sidecar_for_engines_that_cannot_merge(tmp_path: Path) -> None:
    """No vLLM needed: the choice itself. SGLang (no `push_adapter_merge`) keeps the sidecar
    merge whatever is asked; a vLLM engine merges in its workers by default."""
    from harness.workloads.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "model", arch="llama")

    vllm = VLLMEngine("http://127.0.0.1:9")
    try:
        default = UpdateApplier(vllm, model_dir, "merged", 8, "float32", tmp_path / "a")
        assert default.merge_in == "engine"
        chosen = UpdateApplier(vllm, model_dir, "merged", 8, "float32", tmp_path / "a", "sidecar")
        assert chosen.merge_in == "sidecar"
        with pytest.raises(ValueError, match="merge_in"):
            UpdateApplier(vllm, model_dir, "merged", 8, "float32", tmp_path / "a", "gpu")
    finally:
        vllm.close()
    from lorarl.rollout.sglang_engine import SGLangEngine

    sglang = SGLangEngine("http://127.0.0.1:9")
    try:
        assert (
            UpdateApplier(sglang, model_dir, "merged", 8, "float32", tmp_path / "a").merge_in
            == "sidecar"
        )
    finally:
        sglang.close()


@pytest.fixture
def adapters(server):
    shm = Path("/dev/shm") / f"lorarl-test-edge-{os.getpid()}"
    yield shm
    shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture
def restore(server, base_weights):
    yield
    server["engine"].push_merged_weights(((n, base_weights[n]) for n in ALL), version=0)


@pytest.mark.slow
def test_edge_merge_equals_peft_and_does_not_accumulate(
    server,
    base_weights,
    adapters,
    restore,
) -> None:
    engine: VLLMEngine = server["engine"]
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for version, seed in ((1, 21), (2, 22)):  # v2 from the pristine copy, not on top of v1
        lora, merged = peft_adapter(server, adapters / f"v{version}", seed, every)
        engine.push_adapter_merge(lora, SCALING, server["model_dir"], version)
        print(f"\nv{version}: {engine.last_push_seconds} {engine.last_push_bytes} B "
              f"{engine.last_worker_report}")  # fmt: skip
        assert engine.weight_version == version
        assert engine.last_push_bytes < sum(t.nbytes for t in lora.values()) + 4096
        served = read_back(server, ALL)
        for n in ALL:
            assert torch.equal(served[n], merged[n]), n
            assert not torch.equal(served[n], base_weights[n]), n
    tokens, logprobs = complete(server, MODEL_NAME)
    assert logprobs == pytest.approx(reference_logprobs(hf_model(server, merged), tokens), abs=1e-4)


@pytest.mark.slow
def test_untargeted_fused_siblings_keep_the_checkpoint(
    server,
    base_weights,
    adapters,
    restore,
) -> None:
    engine: VLLMEngine = server["engine"]
    _, merged_all = peft_adapter(server, adapters / "all", 31, ["q_proj", "up_proj"])
    engine.push_adapter_merge(
        load_file(str(adapters / "all" / "adapter_model.safetensors")), SCALING,
        server["model_dir"], 3,
    )  # fmt: skip
    served = read_back(server, ALL)
    for n in ALL:
        assert torch.equal(served[n], merged_all[n]), n
        targeted = n.split(".")[-2] in ("q_proj", "up_proj")
        assert torch.equal(served[n], base_weights[n]) != targeted, n


@pytest.mark.slow
def test_a_misshapen_adapter_is_refused_and_the_engine_keeps_serving(
    server,
    base_weights,
    adapters,
) -> None:
    engine: VLLMEngine = server["engine"]
    version = engine.weight_version
    lora, _ = peft_adapter(server, adapters / "bad", 41, ["o_proj"])
    name = next(n for n in lora if n.endswith("lora_A.weight"))
    lora[name] = lora[name][:, :-1]
    with pytest.raises(EngineError, match=r"adapter refused: .* do not fit"):
        engine.push_adapter_merge(lora, SCALING, server["model_dir"], 99)  # before the engine
    unchecked = VLLMEngine(server["url"], api_key=engine_tests.API_KEY)  # no known shapes
    try:  # the worker refuses too, before it reloads anything
        with pytest.raises(EngineError, match="do not fit"):
            unchecked.push_adapter_merge(lora, SCALING, server["model_dir"], 99)
    finally:
        unchecked.close()  # its connection may be dropped by the server's 500
    assert engine.weight_version == version and engine.health()
    o = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(read_back(server, [o])[o], base_weights[o])


@pytest.mark.slow
def test_the_applier_serves_the_same_bits_merging_in_the_engine_or_the_sidecar(
    server,
    base_weights,
    adapters,
    restore,
) -> None:
    engine: VLLMEngine = server["engine"]
    lora, merged = peft_adapter(server, adapters / "app", 51, ["q_proj", "v_proj", "down_proj"])
    modules = tuple(sorted(group_lora_pairs(lora)))
    header = SyncHeader(version=7, mode="merged", scaling=SCALING, rank=8, alpha=16.0,
                        target_modules=modules).with_buckets(pack(lora, 1 << 20))  # fmt: skip
    served = {}
    for merge_in in ("sidecar", "engine"):
        applier = UpdateApplier(engine, server["model_dir"], "merged", expected_rank=8,
                                engine_dtype="float32", adapter_root=adapters / "root",
                                merge_in=merge_in)  # fmt: skip
        assert applier.merge_in == merge_in
        applied = applier.apply(header, lora)
        print(f"\n{merge_in}: {applied.seconds} pushed {engine.last_push_bytes} B")
        served[merge_in] = read_back(server, ALL)
        # back to the checkpoint between the two, so each is checked on its own
        engine.push_merged_weights(((n, base_weights[n]) for n in ALL), version=0)
    for n in ALL:
        assert torch.equal(served["engine"][n], served["sidecar"][n]), n
        assert torch.equal(served["engine"][n], merged[n]), n


# ---------------------------------------------------------------- tensor parallel (TP=2 on CPU)

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory: pytest.TempPathFactory, engine_python: str):
    """The tiny Llama served with --tensor-parallel-size 2: two CPU workers, one core each
    (vLLM refuses to bind two workers' threads on one NUMA node by itself)."""
    import subprocess
    import time

    from harness.engines.vllm_serve import stop_server_group
    from harness.workloads.tiny_models import make_tiny_model
    from lorarl.local.ports import free_port
    from lorarl.rollout.vllm_engine import checkpoint_weight_shapes, vllm_launch_command

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("TP=2 needs two CPUs")
    root = tmp_path_factory.mktemp("vllm-tp2")
    model_dir = make_tiny_model(root / "model", arch="llama")
    port = free_port()
    argv, env = vllm_launch_command(
        model_dir, port, served_model_name=MODEL_NAME, run_dir=root / "run", dtype="float32",
        max_model_len=256, python=engine_python, extra_args=["--tensor-parallel-size", "2"],
    )  # fmt: skip
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1]}"
    Path(env["TMPDIR"]).mkdir(parents=True)
    log = open(root / "vllm.log", "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    shm = Path("/dev/shm") / f"lorarl-test-tp2-{os.getpid()}"
    engine = VLLMEngine(f"http://127.0.0.1:{port}", shm_dir=shm,
                        known_shapes=checkpoint_weight_shapes(model_dir))  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not engine.health():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM TP=2 did not start:\n{(root / 'vllm.log').read_text()[-4000:]}"
                )
            time.sleep(0.25)
        yield {"engine": engine, "url": f"http://127.0.0.1:{port}", "model_dir": model_dir,
               "root": root}  # fmt: skip
    finally:
        engine.close()
        stop_server_group(proc)
        log.close()
        shutil.rmtree(shm, ignore_errors=True)


def read_back_tp(server, names: list[str], world: int = 2) -> dict[str, torch.Tensor]:
    """Each worker's shard, put back together: column-parallel layers split output rows (unless
    the shard is the whole weight: KV heads replicated when TP > KV heads), row-parallel layers
    (o_proj, down_proj) split input columns."""
    out = server["root"] / "readback-{rank}.safetensors"
    server["engine"].collective_rpc("lorarl_read_weights", names=names, out_path=str(out))
    shards = [load_file(str(out).replace("{rank}", str(r))) for r in range(world)]
    full = {}
    for n in names:
        parts = [s[n] for s in shards]
        if n.split(".")[-2] not in COLUMN_PARALLEL:
            full[n] = torch.cat(parts, dim=1)
        elif all(torch.equal(p, parts[0]) for p in parts[1:]) and n.split(".")[-2] in (
            "k_proj", "v_proj",
        ):  # fmt: skip
            full[n] = parts[0]
        else:
            full[n] = torch.cat(parts, dim=0)
    return full


@pytest.mark.slow
def test_tp2_each_worker_merges_its_shard_exactly(tp2_server, adapters) -> None:
    from safetensors.torch import load_file as load

    engine: VLLMEngine = tp2_server["engine"]
    base = load(str(tp2_server["model_dir"] / "model.safetensors"))
    assert read_back_tp(tp2_server, ALL).keys() == set(ALL)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for version, seed in ((1, 61), (2, 62)):
        lora, merged = peft_adapter(tp2_server, adapters / f"tp-v{version}", seed, every)
        engine.push_adapter_merge(lora, SCALING, tp2_server["model_dir"], version)
        assert len(engine.last_worker_report) == 2  # both workers merged
        served = read_back_tp(tp2_server, ALL)
        for n in ALL:
            assert torch.equal(served[n], merged[n]), n
            assert not torch.equal(served[n], base[n]), n
    tokens, logprobs = complete(tp2_server, MODEL_NAME)
    ref = reference_logprobs(hf_model(tp2_server, merged), tokens)
    assert logprobs == pytest.approx(ref, abs=1e-4)
