"""VLLMEngine against a real vLLM CPU server on a tiny Llama (fp32, so served == pushed exactly).

Weight updates are verified by reading the weights the engine computes with back through the
worker extension (identity matrix through each layer), and generation is checked against
Hugging Face / PEFT logprobs computed in the test, never against stored numbers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from harness.engines.vllm_serve import stop_server_group
from lorarl.engines.vllm import vllm_cache_root
from lorarl.local.ports import free_port
from lorarl.rollout.engine import EngineError, missing_fused_siblings, validate_merged_update
from lorarl.rollout.vllm_engine import (
    WORKER_EXTENSION,
    VLLMEngine,
    checkpoint_weight_shapes,
    vllm_launch_command,
)

MODEL_NAME = "tiny"
API_KEY = "engine-key-for-tests"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
PROJ += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
PROMPT = [20, 21, 22, 30, 31, 40, 50, 60]


def layer_names(layer: int) -> list[str]:
    return [f"model.layers.{layer}.{p}.weight" for p in PROJ]


# ---------------------------------------------------------------- no vLLM needed


def test_launch_command_renders_flags_and_env(tmp_path: Path) -> None:
    argv, env = vllm_launch_command(
        "/models/m", 8123, served_model_name="m", run_dir=tmp_path, dtype="float32",
        enable_lora=True, max_lora_rank=32, max_loras=4, kv_cache_gib=2, max_model_len=512,
        api_key="k", python="/venv/bin/python", extra_args=["--seed", "7"],
    )  # fmt: skip
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--model"), flag("--port"), flag("--host")) == ("/models/m", "8123", "127.0.0.1")
    assert (flag("--served-model-name"), flag("--dtype")) == ("m", "float32")
    assert (flag("--max-lora-rank"), flag("--max-loras"), flag("--max-model-len")) == (
        "32", "4", "512",
    )  # fmt: skip
    assert flag("--worker-extension-cls") == WORKER_EXTENSION
    assert "--api-key" not in argv and env["VLLM_API_KEY"] == "k"
    assert "--enable-lora" in argv and "--enforce-eager" in argv
    assert argv[-2:] == ["--seed", "7"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    for key in ("TMPDIR", "RAY_TMPDIR"):
        assert Path(env[key]).is_relative_to(tmp_path), key
    assert env["VLLM_CACHE_ROOT"] == vllm_cache_root(os.environ, str(Path.home()))

    plain, _ = vllm_launch_command("/m", 1, served_model_name="m", run_dir=tmp_path)
    assert "--enable-lora" not in plain and "--api-key" not in plain
    with pytest.raises(ValueError, match="port"):
        vllm_launch_command("/m", 70000, served_model_name="m", run_dir=tmp_path)
    with pytest.raises(ValueError, match="dtype"):
        vllm_launch_command("/m", 1, served_model_name="m", run_dir=tmp_path, dtype="fp32")
    with pytest.raises(ValueError, match="kv_cache_gib"):
        vllm_launch_command("/m", 1, served_model_name="m", run_dir=tmp_path, kv_cache_gib=0)


def test_fused_group_rule() -> None:
    names = ["m.layers.0.self_attn.q_proj.weight", "m.layers.0.self_attn.k_proj.weight"]
    names += ["m.layers.0.mlp.gate_proj.weight", "m.layers.0.mlp.up_proj.weight"]
    names += ["m.layers.0.self_attn.o_proj.weight"]
    missing = missing_fused_siblings(names)
    assert missing == {
        "m.layers.0.self_attn.k_proj.weight": ["m.layers.0.self_attn.v_proj.weight"],
        "m.layers.0.self_attn.q_proj.weight": ["m.layers.0.self_attn.v_proj.weight"],
    }
    t = torch.zeros(1)
    with pytest.raises(EngineError, match="partial fused group"):
        validate_merged_update(dict.fromkeys(names, t))
    with pytest.raises(EngineError, match="PEFT name"):
        validate_merged_update({"base_model.model.x.o_proj.base_layer.weight": t})
    with pytest.raises(EngineError, match="not in the served checkpoint"):
        validate_merged_update({"x.o_proj.weight": t}, known_shapes={"y.o_proj.weight": (1,)})
    with pytest.raises(EngineError, match=r"shape \(1,\), the checkpoint's is \(2, 1\)"):
        validate_merged_update({"x.o_proj.weight": t}, known_shapes={"x.o_proj.weight": (2, 1)})
    validate_merged_update({"x.o_proj.weight": t}, known_shapes={"x.o_proj.weight": [1]})


# ---------------------------------------------------------------- real vLLM server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, engine_python: str):
    from harness.workloads.tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("vllm")
    model_dir = make_tiny_model(root / "model", arch="llama")
    port = free_port()
    argv, env = vllm_launch_command(
        model_dir, port, served_model_name=MODEL_NAME, run_dir=root / "run", dtype="float32",
        enable_lora=True, max_lora_rank=8, max_loras=2, kv_cache_gib=1, max_model_len=256,
        python=engine_python, api_key=API_KEY,
    )  # fmt: skip
    Path(env["TMPDIR"]).mkdir(parents=True)
    log = open(root / "vllm.log", "w")  # noqa: SIM115 - closed at teardown
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    engine_shm = Path("/dev/shm") / f"lorarl-test-{os.getpid()}"
    engine = VLLMEngine(
        f"http://127.0.0.1:{port}",
        api_key=API_KEY,
        shm_dir=engine_shm,
        known_shapes=checkpoint_weight_shapes(model_dir),
    )
    try:
        deadline = time.monotonic() + 300
        while not engine.health():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (root / "vllm.log").read_text()[-4000:]
                raise RuntimeError(f"vLLM did not start:\n{tail}")
            time.sleep(0.25)
        print(f"\nvLLM ready in {time.perf_counter() - t0:.1f} s")
        yield {"engine": engine, "url": f"http://127.0.0.1:{port}", "model_dir": model_dir,
               "root": root}  # fmt: skip
    finally:
        engine.close()
        stop_server_group(proc)
        log.close()
        shutil.rmtree(engine_shm, ignore_errors=True)


@pytest.fixture(scope="module")
def base_weights(server) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(server["model_dir"] / "model.safetensors"))


@pytest.fixture
def restore_base(server, base_weights):
    """Tests that push weights leave the engine serving the checkpoint again."""
    yield
    names = [n for layer in (0, 1) for n in layer_names(layer)]
    server["engine"].push_merged_weights(((n, base_weights[n]) for n in names), version=0)


def read_back(server, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = server["root"] / f"readback-{time.monotonic_ns()}.safetensors"
    shapes = server["engine"].collective_rpc("lorarl_read_weights", names=names, out_path=str(out))
    assert set(shapes[0]) == set(names)
    return load_file(str(out))


def complete(server, model: str, max_tokens: int = 8) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{server['url']}/v1/completions", json=body, timeout=60, headers=AUTH)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def reference_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """Logprob of each generated token under a Hugging Face (or PEFT) model, fp32."""
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logp[len(PROMPT) + i - 1, t].item() for i, t in enumerate(tokens)]


def hf_model(server, overrides: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(server["model_dir"], dtype=torch.float32)
    if overrides:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in overrides.items():
                params[name].copy_(value)
    return model.eval()


def lora_perturbation(base: dict[str, torch.Tensor], names: list[str], seed: int, rank: int = 4):
    """W = W_base + s·B@A in fp32 with s = alpha/r = 2, as the sidecar computes merged weights."""
    g = torch.Generator().manual_seed(seed)
    merged = {}
    for n in names:
        out_f, in_f = base[n].shape
        a = torch.randn(rank, in_f, generator=g) * 0.05
        b = torch.randn(out_f, rank, generator=g) * 0.05
        merged[n] = base[n] + 2.0 * (b @ a)
    return merged


@pytest.mark.slow
def test_the_engine_refuses_requests_without_the_key(server) -> None:
    """VLLM_API_KEY locks generation and adapter loading; /health stays open for probes."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = httpx.post(f"{server['url']}/v1/completions", json=body, headers=headers)
        assert resp.status_code == 401, resp.text
    resp = httpx.post(
        f"{server['url']}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"}
    )
    assert resp.status_code == 401
    assert httpx.get(f"{server['url']}/health").status_code == 200
    allowed = httpx.post(f"{server['url']}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert allowed.status_code == 200, allowed.text


@pytest.mark.slow
def test_generate_matches_hf_logprobs(server) -> None:
    tokens, logprobs = complete(server, MODEL_NAME)
    assert len(tokens) == 8
    ref = reference_logprobs(hf_model(server), tokens)
    assert logprobs == pytest.approx(ref, abs=1e-4)


@pytest.mark.slow
def test_push_merged_layer_is_served_exactly(server, base_weights, restore_base) -> None:
    engine: VLLMEngine = server["engine"]
    names = layer_names(0)
    merged = lora_perturbation(base_weights, names, seed=1)

    t0 = time.perf_counter()
    engine.push_merged_weights(merged.items(), version=3)
    print(f"\npush 7 tensors: {time.perf_counter() - t0:.3f} s {engine.last_push_seconds}")
    assert engine.weight_version == 3

    served = read_back(server, names + layer_names(1))
    for n in names:
        assert torch.equal(served[n], merged[n]), n
        assert not torch.equal(served[n], base_weights[n]), n
    for n in layer_names(1):  # untouched layer keeps the checkpoint
        assert torch.equal(served[n], base_weights[n]), n

    tokens, logprobs = complete(server, MODEL_NAME)
    assert logprobs == pytest.approx(reference_logprobs(hf_model(server, merged), tokens), abs=1e-4)
    assert logprobs != pytest.approx(reference_logprobs(hf_model(server), tokens), abs=1e-4)


@pytest.mark.slow
def test_push_all_layers_then_restore(server, base_weights, restore_base) -> None:
    engine: VLLMEngine = server["engine"]
    names = layer_names(0) + layer_names(1)
    merged = lora_perturbation(base_weights, names, seed=2)
    t0 = time.perf_counter()
    engine.push_merged_weights(merged.items(), version=4)
    print(f"\npush all {len(names)} tensors: {time.perf_counter() - t0:.3f} s")
    served = read_back(server, names)
    assert all(torch.equal(served[n], merged[n]) for n in names)

    engine.push_merged_weights(((n, base_weights[n]) for n in names), version=5)
    served = read_back(server, names)
    assert all(torch.equal(served[n], base_weights[n]) for n in names)
    tokens, logprobs = complete(server, MODEL_NAME)
    assert logprobs == pytest.approx(reference_logprobs(hf_model(server), tokens), abs=1e-4)


@pytest.mark.slow
def test_bad_updates_are_refused_before_reaching_the_engine(server, base_weights) -> None:
    engine: VLLMEngine = server["engine"]
    version = engine.weight_version
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(EngineError, match="partial fused group"):
        engine.push_merged_weights([(q, base_weights[q] + 1.0)], version=99)
    with pytest.raises(EngineError, match="not in the served checkpoint"):
        engine.push_merged_weights([("model.layers.0.mlp.nope.weight", torch.zeros(2))], 99)
    o = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(EngineError, match="has shape"):
        engine.push_merged_weights([(o, base_weights[o][:, :64])], 99)
    assert engine.weight_version == version
    assert engine.health()
    assert torch.equal(read_back(server, [q])[q], base_weights[q])


def save_peft_adapter(server, out: Path, seed: int):
    """A real PEFT LoRA on the same tiny model, B non-zero so it changes outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"],
    )  # fmt: skip
    peft_model = get_peft_model(hf_model(server), cfg)
    peft_model.save_pretrained(out)
    return peft_model.eval()


@pytest.mark.slow
def test_adapter_load_reload_in_place_unload(server) -> None:
    engine: VLLMEngine = server["engine"]
    shm = Path("/dev/shm") / f"lorarl-test-adapters-{os.getpid()}"
    try:
        first = save_peft_adapter(server, shm / "job-a-v1", seed=11)
        t0 = time.perf_counter()
        engine.load_adapter(shm / "job-a-v1", "job-a", version=1)
        print(f"\nadapter load: {time.perf_counter() - t0:.3f} s")
        assert engine.weight_version == 1
        tokens, logprobs = complete(server, "job-a")
        assert logprobs == pytest.approx(reference_logprobs(first, tokens), abs=1e-4)
        base_tokens, base_logprobs = complete(server, MODEL_NAME)
        assert base_logprobs == pytest.approx(
            reference_logprobs(hf_model(server), base_tokens), abs=1e-4
        )
        assert (tokens, logprobs) != (base_tokens, base_logprobs)

        second = save_peft_adapter(server, shm / "job-a-v2", seed=12)
        t0 = time.perf_counter()
        engine.load_adapter(shm / "job-a-v2", "job-a", version=2)
        print(f"adapter reload in place: {time.perf_counter() - t0:.3f} s")
        assert engine.weight_version == 2
        tokens2, logprobs2 = complete(server, "job-a")
        assert logprobs2 == pytest.approx(reference_logprobs(second, tokens2), abs=1e-4)
        assert logprobs2 != pytest.approx(reference_logprobs(first, tokens2), abs=1e-4)

        engine.unload_adapter("job-a")
        body = {"model": "job-a", "prompt": PROMPT, "max_tokens": 2}
        gone = httpx.post(f"{server['url']}/v1/completions", json=body, timeout=60, headers=AUTH)
        assert gone.status_code == 404, gone.text
        with pytest.raises(EngineError, match="unload adapter 'job-a'"):
            engine.unload_adapter("job-a")
        with pytest.raises(EngineError, match=r"adapter_config\.json"):
            engine.load_adapter(shm / "missing", "job-b", version=3)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_sampled_logprobs_are_those_of_the_temperature_scaled_distribution(server) -> None:
    """Issue 13 #2: the trainer scores softmax(z / T); vLLM must report the same distribution
    (`--logprobs-mode processed_logprobs`), not its default raw softmax(z)."""
    temperature = 0.7
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": temperature,
            "seed": 3, "logprobs": 0, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(f"{server['url']}/v1/completions", json=body, timeout=60, headers=AUTH)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logits = hf_model(server)(ids).logits[0].float()
    pos = [len(PROMPT) + i - 1 for i in range(len(tokens))]
    scaled = torch.log_softmax(logits / temperature, dim=-1)[pos, tokens].tolist()
    raw = torch.log_softmax(logits, dim=-1)[pos, tokens].tolist()
    gap_raw = max(abs(a - b) for a, b in zip(served, raw, strict=True))
    print(f"\nT={temperature}: max |served - scaled| "
          f"{max(abs(a - b) for a, b in zip(served, scaled, strict=True)):.2e}, "
          f"max |served - raw| {gap_raw:.2e}")  # fmt: skip
    assert served == pytest.approx(scaled, abs=1e-4)
    assert gap_raw > 1e-2  # the check can tell the two apart


@pytest.mark.slow
def test_stop_strings_min_p_and_repetition_penalty_through_the_client(server) -> None:
    """Issue 14 #6: our request builder's stop / min_p / repetition_penalty reach vLLM's own
    validation and sampler, and the samples keep ids and logprobs aligned."""
    from harness.workloads.tiny_models import make_tokenizer
    from lorarl.trainer.generation.client import RolloutClient
    from lorarl.trainer.generation.types import SamplingParams

    client = RolloutClient([server["url"]], "vllm", model_name=MODEL_NAME, api_key=API_KEY)
    tok = make_tokenizer()

    def one(**kw):
        params = SamplingParams(max_tokens=16, **kw)
        (sample,) = client.generate([PROMPT], 1, params, expected_version=0)[0]
        assert len(sample.logprobs) == len(sample.completion_ids)
        return sample

    greedy = one(temperature=0.0)
    assert greedy.finish_reason == "length" and len(greedy.completion_ids) == 16
    pieces = [tok.decode([t], skip_special_tokens=True) for t in greedy.completion_ids]
    # A stop string: the first character of the completion that did not appear before it.
    k = next(i for i in range(2, 16) if pieces[i].strip() and pieces[i] not in "".join(pieces[:i]))
    stopped = one(temperature=0.0, stop=(pieces[k],))
    assert stopped.finish_reason == "stop"  # so the overlong handling does not treat it as cut
    assert stopped.text == "".join(pieces[:k])  # vLLM's default: the stop string left out ...
    assert stopped.completion_ids == greedy.completion_ids[: k + 1]  # ... its token kept
    assert stopped.logprobs == pytest.approx(greedy.logprobs[: k + 1], abs=1e-5)

    # Greedy on a random tiny model repeats itself; a strong penalty must change the tokens.
    assert len(set(greedy.completion_ids)) < 16
    penalized = one(temperature=0.0, repetition_penalty=2.0)
    assert penalized.completion_ids != greedy.completion_ids
    assert len(set(penalized.completion_ids)) > len(set(greedy.completion_ids))

    # min_p = 1 keeps only the most likely token: sampling at T=1 becomes greedy, and vLLM
    # reports the logprob of the distribution it sampled from (log 1 = 0), the behavior policy
    # the rollout correction weighs against the trainer's.
    free = one(temperature=1.0, seed=5)
    narrowed = one(temperature=1.0, seed=5, min_p=1.0)
    assert narrowed.completion_ids == greedy.completion_ids != free.completion_ids
    assert narrowed.logprobs == pytest.approx([0.0] * 16, abs=1e-5)
