"""`reward_model`: score (prompt, completion) with a sequence-classification model from a path.

Registered as a factory so the model loads once, when the job (or a Serve replica) binds the
reward, and a missing or incompatible model fails then, not mid-training. The scorer exposes
`score_batch` so the reward service can run one padded forward per batch instead of one per
sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lorarl.rewards.registry import RewardResult, register_factory

__all__ = ["RewardModelScorer", "reward_model"]


class RewardModelScorer:
    """A loaded classifier; one score per text: the logit (1 label) or P(label_index)."""

    def __init__(
        self,
        path: str,
        *,
        batch_size: int = 16,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: str = "float32",
        use_chat_template: bool | None = None,
        label_index: int | None = None,
    ) -> None:
        import torch  # imported here so registering this reward costs nothing
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not Path(path).is_dir():
            raise ValueError(f"reward_model: path {path!r} is not a directory with a model")
        if batch_size < 1 or max_length < 1:
            raise ValueError(
                f"reward_model: batch_size and max_length must be >= 1 "
                f"(got {batch_size}, {max_length})"
            )
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"reward_model: dtype must be float32, bfloat16 or float16 ({dtype!r})"
            )
        self.batch_size, self.max_length = batch_size, max_length
        self.device = torch.device(_resolve_device(device))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:  # needed to find each row's last token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        labels = self.model.config.num_labels
        if labels > 1 and label_index is None:
            raise ValueError(
                f"reward_model: {path} has {labels} labels; set label_index to the one that means "
                "'good' (a 1-label model's logit is used directly)"
            )
        if label_index is not None and not 0 <= label_index < labels:
            raise ValueError(
                f"reward_model: label_index {label_index} out of range 0..{labels - 1}"
            )
        self.label_index = label_index
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.use_chat_template = has_template if use_chat_template is None else use_chat_template
        if self.use_chat_template and not has_template:
            raise ValueError(f"reward_model: use_chat_template is set but {path} has no template")

    def text(self, prompt: str, completion: str) -> str:
        if not self.use_chat_template:
            return prompt + completion
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        assert isinstance(text, str)  # tokenize=False: the rendered text, not token ids
        return text

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        import torch

        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                chunk = list(texts[start : start + self.batch_size])
                enc = self.tokenizer(
                    chunk,
                    add_special_tokens=False,
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                ).to(self.device)
                logits = self.model(**enc).logits.float()
                if self.label_index is None:
                    scores.extend(logits[:, 0].tolist())
                else:
                    scores.extend(logits.softmax(-1)[:, self.label_index].tolist())
        return scores

    def score_batch(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        truths: Sequence[str | None] | None = None,
        metadatas: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[RewardResult]:
        if len(prompts) != len(completions):
            raise ValueError(
                f"reward_model: {len(prompts)} prompts but {len(completions)} completions"
            )
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        return [RewardResult(s) for s in self.score_texts(texts)]

    def __call__(
        self, prompt: str, completion: str, ground_truth: str | None, metadata: Mapping[str, Any]
    ) -> RewardResult:
        return self.score_batch([prompt], [completion])[0]


@register_factory("reward_model")
def reward_model(
    path: str,
    batch_size: int = 16,
    max_length: int = 2048,
    device: str = "cpu",
    dtype: str = "float32",
    use_chat_template: bool | None = None,
    label_index: int | None = None,
) -> RewardModelScorer:
    return RewardModelScorer(
        path,
        batch_size=batch_size,
        max_length=max_length,
        device=device,
        dtype=dtype,
        use_chat_template=use_chat_template,
        label_index=label_index,
    )


def _resolve_device(device: str) -> str:
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"
