"""Prompt datasets: turn rows (`data_files`) into prompts, encode them, and sample batches
resumably.

The sampler is a pure function of (seed, epoch, index), so a checkpoint only needs a
`DataPosition` to continue with exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lorarl.trainer.data.files import DataError, is_missing, lookup, read_rows

__all__ = [
    "DataError",
    "DataPosition",
    "Message",
    "Prompt",
    "PromptDataset",
    "PromptItem",
    "PromptSampler",
    "encode_prompts",
    "prompt_text",
]

Message = dict[str, str]
Prompt = str | list[Message]


@dataclass(frozen=True)
class PromptItem:
    prompt: Prompt
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def prompt_text(prompt: Prompt) -> str:
    """The text a reward sees as `prompt`: the string itself, or the last user message's content."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if message.get("role") == "user":
            return message["content"]
    return prompt[-1]["content"] if prompt else ""


class PromptDataset(Sequence[PromptItem]):
    """Prompts plus how to render them: `chat_template_kwargs` (e.g. `enable_thinking: False`)
    go to every `apply_chat_template` call, at load time and when generating."""

    def __init__(
        self,
        items: Sequence[PromptItem],
        source: str = "<memory>",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not items:
            raise DataError(f"{source}: dataset is empty")
        self._items = list(items)
        self.source = source
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> PromptItem:  # type: ignore[override]
        return self._items[i]

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(self._items)

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        prompt_key: str,
        answer_key: str | None = None,
        *,
        system_prompt: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> PromptDataset:
        """One source: a .jsonl/.parquet file, a folder of shards, or a `save_to_disk` folder.
        Keys may be dotted (`reward_model.ground_truth`) to reach into nested columns."""
        required = (("prompt", prompt_key),) + ((("answer", answer_key),) if answer_key else ())
        rows = read_rows(path, required)
        items = [_to_item(w, r, prompt_key, answer_key, system_prompt) for w, r in rows]
        return cls(items, source=str(path), chat_template_kwargs=chat_template_kwargs)

    @classmethod
    def from_files(
        cls,
        paths: Sequence[str | Path],
        prompt_key: str,
        answer_key: str | None = None,
        *,
        system_prompt: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> PromptDataset:
        """Concatenate several sources in the given order (a job spec lists `trainFiles`)."""
        if not paths:
            raise DataError("no dataset files given")
        parts = [
            cls.from_file(p, prompt_key, answer_key, system_prompt=system_prompt) for p in paths
        ]
        return cls(
            [item for part in parts for item in part],
            source=", ".join(map(str, paths)),
            chat_template_kwargs=chat_template_kwargs,
        )

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[Mapping[str, Any]],
        prompt_key: str,
        answer_key: str | None = None,
        *,
        system_prompt: str | None = None,
        source: str = "<memory>",
    ) -> PromptDataset:
        items = [
            _to_item(f"{source}: row {i + 1}", r, prompt_key, answer_key, system_prompt)
            for i, r in enumerate(rows)
        ]
        return cls(items, source=source)


def _to_item(
    where: str,
    record: Mapping[str, Any],
    prompt_key: str,
    answer_key: str | None,
    system_prompt: str | None,
) -> PromptItem:
    raw_prompt = lookup(record, prompt_key)
    if is_missing(raw_prompt):
        raise DataError(
            f"{where}: row is missing prompt key {prompt_key!r}; "
            f"keys: {', '.join(map(str, record))}"
        )
    prompt = _check_prompt(where, prompt_key, raw_prompt)
    if system_prompt is not None:
        prompt = _with_system(prompt, system_prompt)
    answer = None
    if answer_key is not None:
        value = lookup(record, answer_key)
        if is_missing(value) or value is None:
            raise DataError(f"{where}: row is missing answer key {answer_key!r}")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(
                f"{where}: answer key {answer_key!r} must be a string or number, "
                f"got {type(value).__name__}"
            )
        answer = str(value)
    metadata = {k: v for k, v in record.items() if k not in (prompt_key, answer_key)}
    return PromptItem(prompt=prompt, answer=answer, metadata=metadata)


def _check_prompt(where: str, key: str, value: Any) -> Prompt:
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: prompt key {key!r} is an empty string")
        return value
    if isinstance(value, list) and value:
        messages = []
        for j, m in enumerate(value):
            ok = (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
            )
            if not ok:
                raise DataError(
                    f"{where}: prompt key {key!r} message {j} must be "
                    f'{{"role": str, "content": str}}, got {m!r}'
                )
            messages.append({"role": m["role"], "content": m["content"]})
        return messages
    raise DataError(
        f"{where}: prompt key {key!r} must be a string or a non-empty list of chat messages, "
        f"got {type(value).__name__}"
    )


def _with_system(prompt: Prompt, system_prompt: str) -> list[Message]:
    """A row's own system message wins over the dataset-wide one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[Prompt],
    max_prompt_tokens: int,
    *,
    truncate: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids per prompt, ready for generation.

    With a chat template: render with `add_generation_prompt=True`, then tokenize without special
    tokens (the template writes its own); `chat_template_kwargs` are the template's own variables
    (e.g. Qwen3's `enable_thinking`). Without one: a string is tokenized as is (with the
    tokenizer's special tokens, e.g. BOS); a message list is its contents joined by blank lines.
    A prompt over `max_prompt_tokens` raises DataError, or with `truncate=True` keeps its *last*
    tokens (left truncation keeps the question's end and the generation prompt).
    """
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be > 0, got {max_prompt_tokens}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    encoded = []
    for i, prompt in enumerate(prompts):
        if has_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=False,
                **dict(chat_template_kwargs or {}),
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        ids = list(ids)
        if len(ids) > max_prompt_tokens:
            if not truncate:
                raise DataError(
                    f"prompt {i} has {len(ids)} tokens, over max_prompt_tokens="
                    f"{max_prompt_tokens} (raise the limit or enable truncation)"
                )
            ids = ids[-max_prompt_tokens:]
        encoded.append(ids)
    return encoded


def drop_long_prompts(
    dataset: PromptDataset,
    tokenizer: Any,
    max_prompt_tokens: int,
    *,
    lengths: Sequence[int] | None = None,
) -> tuple[PromptDataset, int]:
    """The prompts that fit `max_prompt_tokens` once rendered, and how many were dropped.

    Done once at load time (verl's `filter_overlong_prompts`): a long prompt sampled mid-run
    would otherwise fail the step. `lengths` are the prompts' token counts as they will be sent
    when something else renders them (an environment's first messages, tool description
    included: `episodes.episode_prompt_lengths`); default: the chat template's rendering of the
    row. Fails only if nothing is left.
    """
    if lengths is None:
        prompts = [it.prompt for it in dataset]
        encoded = encode_prompts(
            tokenizer, prompts, 2**62, chat_template_kwargs=dataset.chat_template_kwargs
        )
        lengths = [len(ids) for ids in encoded]
    elif len(lengths) != len(dataset):
        raise ValueError(f"{len(lengths)} lengths for {len(dataset)} prompts")
    kept = [it for it, n in zip(dataset, lengths, strict=True) if n <= max_prompt_tokens]
    if not kept:
        raise DataError(
            f"{dataset.source}: all {len(dataset)} prompts are longer than "
            f"data.maxPromptTokens={max_prompt_tokens} (the shortest has {min(lengths)} tokens)"
        )
    kept_ds = PromptDataset(kept, dataset.source, dataset.chat_template_kwargs)
    return kept_ds, len(dataset) - len(kept)


@dataclass(frozen=True)
class DataPosition:
    """Where the sampler stands: `index` items into epoch `epoch`'s permutation."""

    epoch: int = 0
    index: int = 0

    def __post_init__(self) -> None:
        for name in ("epoch", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DataPosition.{name} must be an integer >= 0, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataPosition:
        missing = {"epoch", "index"} - set(data)
        if missing:
            raise ValueError(f"DataPosition is missing {sorted(missing)}")
        return cls(epoch=data["epoch"], index=data["index"])


class PromptSampler:
    """Deterministic, resumable batches of dataset indices.

    Epoch e visits every index once, in `torch.randperm` order from a CPU generator seeded with
    `seed + e` (same order on any machine for a given torch version). Batches are always full:
    a batch that runs past the end of an epoch continues into the next epoch's permutation, so
    near an epoch boundary one batch can hold the same index twice (and if batch_size > n_items,
    it spans several epochs).
    """

    def __init__(self, n_items: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if n_items <= 0:
            raise ValueError(f"n_items must be > 0, got {n_items}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        self.n_items = n_items
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._cached: tuple[int, list[int]] | None = None

    def permutation(self, epoch: int) -> list[int]:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        if self.shuffle:
            gen = torch.Generator(device="cpu").manual_seed(self.seed + epoch)
            order = torch.randperm(self.n_items, generator=gen).tolist()
        else:
            order = list(range(self.n_items))
        self._cached = (epoch, order)
        return order

    def next_batch(self, position: DataPosition) -> tuple[list[int], DataPosition]:
        if position.index >= self.n_items:
            raise ValueError(
                f"position index {position.index} is out of range for {self.n_items} items "
                "(did the dataset change since the checkpoint?)"
            )
        epoch, index = position.epoch, position.index
        batch: list[int] = []
        while len(batch) < self.batch_size:
            take = min(self.batch_size - len(batch), self.n_items - index)
            batch.extend(self.permutation(epoch)[index : index + take])
            index += take
            if index == self.n_items:
                epoch, index = epoch + 1, 0
        return batch, DataPosition(epoch=epoch, index=index)
