"""Token ids between two model turns, rendered once and never re-tokenized
(docs/environments.md#token-exact-trajectories).

An episode's sequence is the prompt, then for each turn the tokens the engine sampled, then the
tokens of whatever the environment said, then the next generation prompt. Re-rendering the whole
conversation with the chat template each turn would re-tokenize the model's earlier replies, and
BPE does not round-trip: the trainer would then score tokens the engine never sampled. So only the
*new* text between turns is tokenized, as the difference of two renders of a probe conversation:

    render([user, assistant(SENTINEL)])                   ... SENTINEL<end-of-turn>
    render([user, assistant(SENTINEL), *new], gen=True)   ... SENTINEL<end-of-turn><new><gen>

The difference is `<new><gen>`; the text after SENTINEL is the template's end of an assistant turn
(`<|im_end|>\\n` for ChatML). The part of it the model produced itself (its stop token) is not
added again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lorarl.trainer.data.prompts import DataError

SENTINEL = "\u2063lorarl-turn\u2063"
_PROBE_USER = {"role": "user", "content": "?"}


class TurnTokens:
    """Renders the tokens after a model turn for a tokenizer with a chat template."""

    def __init__(self, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "spec.environment needs a tokenizer with a chat template (the model's turns and "
                "the environment's messages are rendered with it)"
            )
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        base = self._render([_PROBE_USER, _assistant(SENTINEL)], generation_prompt=False)
        at = base.rfind(SENTINEL)
        if at < 0:
            raise DataError("the chat template drops assistant messages; multi-turn needs them")
        self._base = base
        self.end_of_turn = base[at + len(SENTINEL) :]

    def prompt(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The first prompt: the messages and the generation prompt."""
        text = self._render(list(messages), generation_prompt=True)
        return self._encode(text)

    def after_turn(
        self, model_ids: Sequence[int], messages: Sequence[Mapping[str, Any]]
    ) -> list[int]:
        """Tokens to append after the model's turn `model_ids`: the rest of the template's end of
        turn, `messages` and the generation prompt of the next assistant turn."""
        full = self._render([_PROBE_USER, _assistant(SENTINEL), *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise DataError(
                "the chat template renders an earlier assistant turn differently once more "
                "messages follow it; lorarl cannot append turns to it token-exactly"
            )
        return self._encode(self._end_rest(model_ids) + full[len(self._base) :])

    def _end_rest(self, model_ids: Sequence[int]) -> str:
        """The end-of-turn text the model did not write: all of it, unless the model's last token
        (its stop token, e.g. `<|im_end|>`) starts it."""
        if not model_ids:
            return self.end_of_turn
        last = model_ids[-1]
        text = self.tokenizer.decode([last], skip_special_tokens=False)
        if text and self.end_of_turn.startswith(text):
            return self.end_of_turn[len(text) :]
        return self.end_of_turn

    def _render(self, messages: list[Mapping[str, Any]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.kwargs
        )

    def _encode(self, text: str) -> list[int]:
        # The template writes its own special tokens (BOS included where it wants one).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}
