"""The quickstart's model (`lorarl prepare quickstart`): what the README promises a newcomer rests
on it knowing the answer's format and neighbourhood but not the rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lorarl.data_tasks import NEXT_LETTER_PROMPTS
from lorarl.local.models import PREPARED_MARKER, prepare_tiny_llama
from lorarl.local.tiny import make_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return prepare_tiny_llama(tmp_path_factory.mktemp("cache"))


def next_token_probs(model, tok, text: str) -> torch.Tensor:
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return torch.softmax(model(input_ids=ids).logits[0, -1], dim=-1)


def test_answers_with_a_letter_near_the_right_one_but_not_the_rule(model_dir: Path):
    tok = make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    right = []
    for c in NEXT_LETTER_PROMPTS:
        chat = [{"role": "user", "content": f"after {c}"}]
        prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        probs = next_token_probs(model, tok, prompt)
        near = [tok.convert_tokens_to_ids(chr(ord(c) + k)) for k in range(4)]
        assert probs[near].sum() > 0.9, c  # the format: one letter from c..f
        right.append(probs[near[1]].item())
        stop = next_token_probs(model, tok, prompt + chr(ord(c) + 1))[tok.eos_token_id]
        assert stop > 0.9, c  # ...then it stops
    # Not the rule: the right letter is one of four equally likely ones (RL must find it).
    assert 0.15 < sum(right) / len(right) < 0.35, right


def test_prepared_once(model_dir: Path):
    assert (model_dir / PREPARED_MARKER).is_file()
    stamp = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_tiny_llama(model_dir.parent) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_prepared_files_are_readable_by_a_non_root_pod(model_dir: Path):
    """Pods run as uid 10001 and read the model from a volume the prepared folder is copied to;
    safetensors writes 0600 files, which such a pod cannot open."""
    for path in [model_dir, *model_dir.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
