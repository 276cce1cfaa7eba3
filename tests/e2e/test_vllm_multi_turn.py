"""Multi-turn episodes (`spec.environment`) on a real vLLM CPU engine (issue 19).

One engine, LoRA on, serving the taught tiny model as "base" and a PEFT adapter under the
versioned name a job's sidecar gives it (`adapter_name(N)`). `EpisodeRunner` plays LetterRelay
(two turns) against it, once with the base model and once with the adapter, and for each:

- the trajectory is token-exact: the Hugging Face (or PEFT) model scoring the whole sequence at
  the sampling temperature gives the engine's logprobs of every model token (environment tokens
  are masked), so every turn came from the model asked for and nothing was re-tokenized;
- the second turns reuse the first turns' KV cache: vLLM's Prometheus counters
  (`vllm:prefix_cache_queries` / `_hits`) grow by exactly the prompt tokens sent and the whole
  cached blocks of each episode's first turn.

vLLM caches whole KV blocks only, and its CPU platform's default block is 128 tokens: an
episode shorter than that would hit nothing. So each episode's first prompt gets a system message
that makes it span one block, different per episode so no two episodes share a block: every hit
is then a second turn finding its own episode's first turn. Prefix caching is vLLM's default
(lorarl never turns it off); the engine's `vllm:cache_config_info` says it is on.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.engines.vllm_serve import stop_server_group
from harness.workloads.letter_relay import LetterRelay
from harness.workloads.tiny_models import taught_letter_model
from lorarl.environments.base import item_messages
from lorarl.local.ports import free_port
from lorarl.plan.engines import SERVED_MODEL_NAME
from lorarl.rollout.vllm_engine import VLLMEngine, vllm_launch_command
from lorarl.sync.protocol import adapter_name
from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.environment import Episode, EpisodeRunner
from lorarl.trainer.episodes.turn_tokens import TurnTokens
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.rollouts import _train_sample
from lorarl.trainer.generation.types import SamplingParams
from lorarl.trainer.model.logprobs import sequence_logprobs
from lorarl.trainer.update.batch import collate

API_KEY = "engine-key-for-tests"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
VERSION = 3
TEMPERATURE = 0.7  # not 1: vLLM must report softmax(z/T), what the trainer scores
MAX_LOGPROB_GAP = 1e-4  # per token, as tests/integration/test_vllm_engine.py
MIN_OTHER_MODEL_GAP = 1e-2  # the adapter's tokens scored by the base model: the check has teeth
SYSTEM_CHARS = 130  # one character per token: the first prompt is ~165 tokens, one full block


def items(letters: str, seed: int) -> list[PromptItem]:
    """One item per letter, each behind a system message of its own random letters."""
    rng = random.Random(seed)
    out = []
    for c in letters:
        system = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(SYSTEM_CHARS))
        user = {"role": "user", "content": f"after {c}"}
        messages = [{"role": "system", "content": system}, user]
        out.append(PromptItem(messages, answer=chr(ord(c) + 1)))
    return out


@pytest.fixture(scope="module")
def engine(tmp_path_factory, engine_python: str) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("vllm-multi-turn")
    # replies: a letter, then stop
    model_dir = taught_letter_model(root / "model", "abcdefgh", steps=60)
    port = free_port()
    argv, env = vllm_launch_command(
        model_dir, port, served_model_name=SERVED_MODEL_NAME, run_dir=root / "run",
        dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_gib=1, max_model_len=512,
        python=engine_python, api_key=API_KEY,
    )  # fmt: skip
    Path(env["TMPDIR"]).mkdir(parents=True)
    log_path = root / "vllm.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    client = VLLMEngine(url, api_key=API_KEY)
    try:
        adapter_dir = root / "adapters" / adapter_name(VERSION)
        peft_model = save_adapter(model_dir, adapter_dir)  # while the engine starts
        deadline = time.monotonic() + 300
        while not client.health():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vLLM did not start:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        # How the sidecar serves a step's adapter in adapter mode.
        client.load_adapter(adapter_dir, adapter_name(VERSION), VERSION)
        print(f"\nvLLM ready with the adapter in {time.perf_counter() - t0:.1f} s")
        yield {"url": url, "model_dir": model_dir, "peft": peft_model, "log": log_path}
    finally:
        client.close()
        stop_server_group(proc)


def save_adapter(model_dir: Path, out: Path):
    """A PEFT LoRA on every linear layer, small enough that replies still stop, large enough
    that its logprobs are far from the base model's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, target_modules=targets)
    model = get_peft_model(hf_model(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.2)
    model.save_pretrained(out)
    return model.eval()


def hf_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# ---------------------------------------------------------------- prefix-cache counters


def metrics(url: str) -> dict[str, float]:
    """vLLM's Prometheus counters, summed over label sets (one engine here)."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def cache_config(url: str) -> dict[str, str]:
    """The labels of vLLM's `vllm:cache_config_info`: the cache settings the engine runs with."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def expected_cache(episodes: list[Episode], block: int) -> tuple[int, int]:
    """(queries, hits) the prefix cache must count for these episodes: every prompt sent is
    queried; a first turn hits nothing (no two prompts share a block); a second turn hits the
    whole blocks its first turn computed (its prompt and reply, less the last sampled token,
    whose KV is never computed) that its own prompt covers (vLLM recomputes its last token)."""
    queries = hits = 0
    for e in episodes:
        s, mask = e.sample, list(e.sample.loss_mask)
        first_reply = mask.index(0) if 0 in mask else len(mask)
        queries += len(s.prompt_ids)
        if e.turns == 2:
            second_prompt = mask.index(1, first_reply)
            computed = len(s.prompt_ids) + first_reply - 1
            queries += len(s.prompt_ids) + second_prompt
            hits += min(computed, len(s.prompt_ids) + second_prompt - 1) // block * block
    return queries, hits


# ---------------------------------------------------------------- the runs


def run_episodes(engine: dict, model: str, batch: list[PromptItem], seed: int):
    tok = AutoTokenizer.from_pretrained(engine["model_dir"])
    client = RolloutClient([engine["url"]], "vllm", model_name=SERVED_MODEL_NAME, api_key=API_KEY)
    runner = EpisodeRunner(
        client=client, turn_tokens=TurnTokens(tok), factory=LetterRelay, max_turns=2,
        max_total_tokens=64, max_response_tokens=4, timeout_s=120.0, max_prompt_tokens=200,
    )  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=TEMPERATURE, seed=seed)
    before = metrics(engine["url"])
    t0 = time.perf_counter()
    groups = runner.run(batch, 1, params, model=model, version=VERSION, seed=seed)
    seconds = time.perf_counter() - t0
    after = metrics(engine["url"])
    delta = {
        k: after[k] - before.get(k, 0.0)
        for k in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    }
    episodes = [e for g in groups for e in g]
    for item, e in zip(batch, episodes, strict=True):
        assert e.sample.prompt_ids == runner.turn_tokens.prompt(item_messages(item.prompt))
    return runner, episodes, delta, seconds


def logprob_gaps(episodes: list[Episode], model, pad_id: int) -> torch.Tensor:
    """|trainer - engine| logprob of every model token, the whole trajectory scored at once."""
    batch = collate([_train_sample(e.sample, 0.0, 0.0) for e in episodes], pad_id)
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask, batch.response_mask,
            micro_batch_size=8, temperature=TEMPERATURE,
        )  # fmt: skip
    scored = batch.response_mask.bool()
    assert int(scored.sum()) == sum(sum(e.sample.loss_mask) for e in episodes)
    return (lp.double() - batch.rollout_logprobs.double()).abs()[scored]


def check_episodes(engine: dict, episodes, delta, reference) -> dict[str, float]:
    two_turns = [e for e in episodes if e.turns == 2]
    assert len(two_turns) >= len(episodes) // 2, [(e.turns, e.ending) for e in episodes]
    for e in episodes:
        assert e.sample.weight_version == VERSION
        mask = list(e.sample.loss_mask)
        if e.turns == 2:  # model turn (1), the environment's message (0), model turn (1)
            assert e.ending == "done", e.ending
            runs = [k for k, _ in itertools.groupby(mask)]
            assert runs == [1, 0, 1], mask
    config = cache_config(engine["url"])
    assert config["enable_prefix_caching"] == "True", config
    block = int(config["block_size"])
    # Every first prompt spans a whole block, so every second turn can hit the cache.
    assert all(len(e.sample.prompt_ids) > block for e in episodes), block
    queries, hits = expected_cache(episodes, block)
    got = (delta["vllm:prefix_cache_queries_total"], delta["vllm:prefix_cache_hits_total"])
    assert got == (queries, hits), (got, (queries, hits), block)
    assert hits >= block * len(two_turns) > 0  # each second turn reused its first turn's block
    tok = AutoTokenizer.from_pretrained(engine["model_dir"])
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gap = logprob_gaps(episodes, reference, tok.pad_token_id)
    finally:
        torch.set_num_threads(torch_threads)
    assert gap.max().item() < MAX_LOGPROB_GAP, gap.max()
    return {
        "episodes": len(episodes),
        "two_turn": len(two_turns),
        "block_size": block,
        "prefix_cache_queries": got[0],
        "prefix_cache_hits": got[1],
        "first_prompt_tokens_mean": sum(len(e.sample.prompt_ids) for e in episodes) / len(episodes),
        "logprob_gap_max": gap.max().item(),
        "logprob_gap_mean": gap.mean().item(),
    }


@pytest.mark.slow
def test_base_model_episodes_are_token_exact_and_hit_the_prefix_cache(engine) -> None:
    batch = items("abcdef", seed=1)
    _, episodes, delta, seconds = run_episodes(engine, SERVED_MODEL_NAME, batch, seed=11)
    measured = check_episodes(engine, episodes, delta, hf_model(engine["model_dir"]))
    print(f"\n[base] {measured} episodes_s={seconds:.2f}")


@pytest.mark.slow
def test_adapter_episodes_are_served_by_the_steps_adapter_every_turn(engine) -> None:
    """`model=<adapter name>` on every turn: the PEFT model reproduces every model token's
    logprob, the base model does not. The base model's cache of the same first prompts is no
    use to the adapter (vLLM keys cached blocks by adapter too): its first turns hit nothing."""
    batch = items("bcdefg", seed=2)
    tok = AutoTokenizer.from_pretrained(engine["model_dir"])
    first = [TurnTokens(tok).prompt(item_messages(item.prompt)) for item in batch]
    body = {"model": SERVED_MODEL_NAME, "prompt": first, "max_tokens": 1, "temperature": 0}
    resp = httpx.post(f"{engine['url']}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    name = adapter_name(VERSION)
    _, episodes, delta, seconds = run_episodes(engine, name, batch, seed=12)
    measured = check_episodes(engine, episodes, delta, engine["peft"])
    base_gap = logprob_gaps(episodes, hf_model(engine["model_dir"]), tok.pad_token_id)
    assert base_gap.mean().item() > MIN_OTHER_MODEL_GAP, base_gap.mean()
    print(f"\n[adapter] {measured} base_model_gap_mean={base_gap.mean().item():.3f} "
          f"episodes_s={seconds:.2f}")  # fmt: skip
