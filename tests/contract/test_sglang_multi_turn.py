"""Multi-turn episodes on SGLang, judged by SGLang 0.5.23's own code (issue 19).

`EpisodeRunner` plays LetterRelay through `RolloutClient` against SGLang's real `/generate` route
(sglang_harness: its parsing, request type and API-key middleware; the engine behind it answers
"1</s>", stopped by the end-of-sequence token, as SGLang's reply is shaped). Every turn of every
episode must reach SGLang as a clean `GenerateReqInput` naming the step's adapter in `lora_path`,
whose `input_ids` are the episode so far: turn 2's are turn 1's prompt, turn 1's reply and the
environment's message, token for token. That is what lets SGLang's radix cache serve the second
turn from the first turn's KV: lorarl never turns the cache off (`--disable-radix-cache`), and
SGLang's `ServerArgs` keep it on, LoRA or not, parsed and resolved. vLLM's command likewise never
turns its prefix caching off (its hits are measured in tests/e2e/test_vllm_multi_turn.py).
"""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from harness.workloads.letter_relay import LetterRelay
from lorarl.api import LoRARLJob
from lorarl.environments.base import EpisodeItem, item_messages
from lorarl.local.tiny import make_tiny_model, make_tokenizer
from lorarl.plan.engines import SERVED_MODEL_NAME, sglang_command, vllm_command
from lorarl.sync.protocol import adapter_name
from lorarl.trainer.data.prompts import PromptItem
from lorarl.trainer.episodes.environment import EpisodeRunner
from lorarl.trainer.episodes.turn_tokens import TurnTokens
from lorarl.trainer.generation.client import RolloutClient
from lorarl.trainer.generation.types import SamplingParams
from tests.contract.conftest import Harness

VERSION = 4
ITEMS = [PromptItem(f"after {c}", answer=chr(ord(c) + 1)) for c in "abc"]
GROUP = 2  # episodes per item
SEED = 21
BASE = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "job", "namespace": "ml"},
    "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]}},
}


@pytest.fixture
def stopping_replies(sglang: Harness) -> Any:
    """SGLang answers every turn with "1" and the stop token (finish reason "stop"), so each
    episode takes both turns; the harness's default reply is restored after."""
    tok = make_tokenizer()
    reply = [tok.convert_tokens_to_ids("1"), tok.eos_token_id]
    finish = {"type": "stop", "matched": tok.eos_token_id}
    resp = sglang.http.post("/_contract/reply", json={"output_ids": reply, "finish_reason": finish})
    resp.raise_for_status()
    yield reply
    sglang.http.post("/_contract/reply", json={}).raise_for_status()


def test_each_turn_is_a_clean_request_on_the_episode_prefix_with_the_adapter(
    sglang: Harness, stopping_replies: list[int]
) -> None:
    tok = make_tokenizer()
    turns = TurnTokens(tok)
    client = RolloutClient([sglang.url], "sglang", model_name=SERVED_MODEL_NAME,
                           api_key=sglang.api_key)  # fmt: skip
    runner = EpisodeRunner(
        client=client, turn_tokens=turns, factory=LetterRelay, max_turns=2, max_total_tokens=64,
        max_response_tokens=4, timeout_s=60.0,
    )  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=0.7, seed=5)
    mark, calls0 = len(sglang.raw()), len(sglang.calls())
    name = adapter_name(VERSION)
    groups = runner.run(ITEMS, GROUP, params, model=name, version=VERSION, seed=SEED)

    raw = [r for r in sglang.raw()[mark:] if r["path"] == "/generate"]
    calls = [c for c in sglang.calls()[calls0:] if c["route"] == "/generate"]
    episodes = [e for g in groups for e in g]
    assert len(raw) == len(calls) == 2 * len(episodes)
    for r in raw:  # as sent: every field one GenerateReqInput knows, none missing or misspelled
        assert r["status"] == 200
        check = sglang.check("/generate", r["body"])
        assert (check["type"], check["unknown"], check["missing"], check["errors"]) == (
            "GenerateReqInput", [], [], [],
        )  # fmt: skip
    for c in calls:  # as SGLang parsed it: the adapter, one sample, output logprobs only
        assert c["type"] == "GenerateReqInput" and c["parallel_sample_num"] == 1
        assert c["obj"]["lora_path"] == name, c["obj"]["lora_path"]
        assert c["obj"]["return_logprob"] is True and c["obj"]["logprob_start_len"] == -1

    # The turns each episode must have sent, built independently of the runner: the prompt, then
    # the prompt + the reply + what the environment (same seed) says back, rendered on its own.
    wanted: list[tuple[int, ...]] = []
    for k, (item, e) in enumerate(
        (item, e) for item, group in zip(ITEMS, groups, strict=True) for e in group
    ):
        first = turns.prompt(item_messages(item.prompt))
        env = LetterRelay()
        env.reset(EpisodeItem(item.prompt, item.answer, {}, SEED + k))
        said = env.step(tok.decode(stopping_replies, skip_special_tokens=True)).messages
        second = first + stopping_replies + turns.after_turn(stopping_replies, said)
        assert (e.turns, e.ending) == (2, "done")
        assert e.sample.prompt_ids == first
        assert e.sample.prompt_ids + e.sample.completion_ids == second + stopping_replies
        assert list(e.sample.loss_mask) == [1] * 2 + [0] * (len(second) - len(first) - 2) + [1] * 2
        wanted += [tuple(first), tuple(second)]
    # Exactly these input_ids reached SGLang: turn 2's begin with all of turn 1's, its prefix.
    sent = Counter(tuple(c["obj"]["input_ids"]) for c in calls)
    assert sent == Counter(wanted)


# ------------------------------------------------------------------ prefix caching stays on


def job_spec(**spec: Any):
    doc = copy.deepcopy(BASE)
    for key, value in spec.items():
        doc["spec"].setdefault(key, {}).update(value)
    return LoRARLJob.model_validate(doc).spec


SPECS = {  # what each sync mode's job sets; the tests add to `rollout`
    "merged": {"rollout": {}},
    "adapter": {"rollout": {"syncMode": "adapter"}, "lora": {"rank": 8}},
}


def mode_spec(mode: str, **rollout: Any):
    spec = copy.deepcopy(SPECS[mode])
    spec["rollout"].update(rollout)
    return job_spec(**spec)


FIELDS = ["disable_radix_cache", "enable_lora", "attention_backend"]


def sglang_fields(sglang: Harness, args: list[str], *, resolve: bool) -> dict[str, Any]:
    """`ServerArgs` fields for `args`: as parsed, or as a server resolves them at start."""
    body = {"argv": args, "fields": FIELDS, "resolve": resolve}
    got = sglang.http.post("/_contract/server_args", json=body, timeout=120).json()
    assert "error" not in got, got
    return got["fields"]


@pytest.mark.parametrize("mode", sorted(SPECS))
def test_sglang_radix_cache_stays_on(sglang: Harness, mode: str, tmp_path: Path) -> None:
    """Parsed, and resolved as a server resolves them at start (on a real tiny model folder, on
    CPU): SGLang's radix cache stays on with lorarl's flags, LoRA included; the flag that turns
    it off shows in both, so the check can tell."""
    model = make_tiny_model(tmp_path / "model", "llama")
    argv = sglang_command(mode_spec(mode), str(model), "127.0.0.1", 30000)
    assert "--disable-radix-cache" not in argv
    args = [*argv[3:], "--device", "cpu"]  # the contract env has no GPU
    parsed = sglang_fields(sglang, args, resolve=False)
    resolved = sglang_fields(sglang, args, resolve=True)
    assert parsed["attention_backend"] is None and resolved["attention_backend"]  # it resolved
    for fields in (parsed, resolved):
        assert fields["disable_radix_cache"] is False, fields
        assert bool(fields["enable_lora"]) == (mode == "adapter")
    for resolve in (False, True):
        off = sglang_fields(sglang, [*args, "--disable-radix-cache"], resolve=resolve)
        assert off["disable_radix_cache"] is True


@pytest.mark.parametrize("mode", sorted(SPECS))
@pytest.mark.parametrize("gpus", [0, 1])
def test_vllm_command_leaves_prefix_caching_on(mode: str, gpus: int) -> None:
    """vLLM caches prefixes by default (the e2e test reads `enable_prefix_caching` from a running
    engine started with these flags); no lorarl flag turns it off, CPU or GPU."""
    spec = mode_spec(mode, engine="vllm", gpusPerReplica=gpus)
    argv = vllm_command(spec, "/models/m", "0.0.0.0", 8000)
    assert not [a for a in argv if "prefix-caching" in a or "prefix_caching" in a], argv
    assert ("--enable-lora" in argv) == (mode == "adapter")
