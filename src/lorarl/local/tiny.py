"""Tiny causal LMs and a character tokenizer built from configs: the quickstart's model and the
tests' (nothing comes from a model hub).

Head dim 64 because vLLM's CPU attention rejects 16; a character vocabulary so arithmetic and
"repeat this" tasks tokenize one symbol per token.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list(string.digits + string.ascii_letters + string.punctuation + " \n")
VOCAB_SIZE = 128  # len(SPECIAL_TOKENS) + len(CHARS) == 100, rounded up

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", layers: int = 2, hidden: int = 128, init_std: float = 0.02):
    common: dict[str, Any] = dict(
        initializer_range=init_std,
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(f"unknown tiny arch {arch!r}")


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    init_std: float = 0.02,
) -> Path:
    """Write a randomly initialised model + tokenizer as a Hugging Face folder (fp32).

    RL tests want `init_std` around 0.1: with 0.02 the untrained output head and the final norm
    cap every logit near +-2.5, so no LoRA update can make any token confident.
    """
    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, layers, hidden, init_std))
    model.to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def teach_letter_neighbourhood(
    path: str | Path,
    letters: str,
    offsets: tuple[int, ...] = (0, 1, 2, 3),
    # 150 left one prompt at 0.69 on its neighbourhood on an AVX2-only CPU (the rounding of the
    # same seeded run differs by CPU); 300: >= 0.96 on every prompt there.
    steps: int = 300,
    lr: float = 3e-3,
    batch: int = 64,
    seed: int = 0,
) -> Path:
    """Fine-tune the model at `path` in place (seconds on CPU) to answer "after c" with one letter
    drawn uniformly from c+offsets, then stop.

    Why: a random model says the right letter ~3% of the time, so most GRPO groups are all wrong
    and carry no signal (the quickstart went 0.03 -> 0.13 in 30 steps at a KL of 3.5 nats). This
    model knows the answer's format and neighbourhood but not which letter is right (p = 1/4 with
    the default offsets), as a pretrained LLM half knows a task; every rise above that comes from
    the RL loop.
    """
    # One thread: the batches are tiny, and on a busy 2-core machine two threads contend (50
    # steps took 46 s with 2 threads, 7 s with 1, at load ~8).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _teach(Path(path), letters, offsets, steps, lr, batch, seed)
    finally:
        torch.set_num_threads(threads)
    return Path(path)


def _teach(
    path: Path, letters: str, offsets: tuple[int, ...], steps: int, lr: float, batch: int, seed: int
) -> None:
    tok = make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    rng = torch.Generator().manual_seed(seed)
    # Rendered as the trainer renders a prompt: the chat template, then no special tokens.
    chats = [[{"role": "user", "content": f"after {c}"}] for c in letters]
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chats]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    answers = [[tok.convert_tokens_to_ids(chr(ord(c) + o)) for o in offsets] for c in letters]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(letters), (batch,), generator=rng).tolist()
        picks = torch.randint(len(offsets), (batch,), generator=rng).tolist()
        pairs = zip(rows, picks, strict=True)
        ids = [prompts[r] + [answers[r][p], tok.eos_token_id] for r, p in pairs]
        width = max(map(len, ids))
        x = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in ids])
        labels = torch.full_like(x, -100)  # only the answer and the stop token are taught
        for i, s in enumerate(ids):
            labels[i, len(s) - 2 : len(s)] = x[i, len(s) - 2 : len(s)]
        loss = model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path, safe_serialization=True)
