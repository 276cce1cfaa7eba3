"""PPO's critic on the actor's base model: a second LoRA adapter plus a scalar value head.

One frozen base carries two PEFT adapters: the actor ("default", the only one synced, checkpointed
as "the adapter" and exported as the normal PEFT adapter) and the critic ("critic"). The value head
is an fp32 `nn.Linear(hidden_size, 1)` on the decoder's last hidden state (after the final norm),
zero-initialised so V = 0 at the start on every rank. The usual alternative, a second full model
for the critic, costs a second copy of the base weights (bench/ppo_memory.py measures both).

The critic forward switches the LoRA layers' active adapter directly instead of calling PEFT's
`set_adapter`, which also flips `requires_grad` of the inactive adapter: both adapters must stay
trainable because each has its own optimizer.
"""

from __future__ import annotations

import json
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lorarl.sync.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_adapter_dir
from lorarl.trainer.model.loading import (
    ADAPTER_NAME,
    AdapterError,
    LoraSettings,
    copy_full_into,
    lora_config,
    lora_parameters,
    lora_state_dict,
    set_lora_state_dict,
)
from lorarl.trainer.model.logprobs import (
    check_shapes,
    first_scored_position,
    position_ids_from_mask,
    used_width,
)
from lorarl.trainer.model.micro_batches import row_lengths, token_micro_batches

CRITIC_ADAPTER = "critic"
CRITIC_FORWARD = "critic_hidden"
VALUE_HEAD = "value_head"
HEAD_PREFIX = f"{VALUE_HEAD}."


def add_critic(model: PeftModel, settings: LoraSettings) -> None:
    """Add the critic adapter and the value head to a PEFT model, before sharding.

    The actor stays the active adapter; both adapters and the head are trainable afterwards.
    """
    if not isinstance(model, PeftModel):
        raise TypeError(f"add_critic needs a PeftModel, got {type(model).__name__}")
    if has_critic(model):
        raise ValueError("the model already has a critic")
    if isinstance(model, FSDPModule):  # the critic's forward method would miss FSDP's hooks
        raise RuntimeError("add_critic must run before shard_model")
    hidden = getattr(model.get_base_model().config, "hidden_size", None)
    if not isinstance(hidden, int) or hidden <= 0:
        raise ValueError("the base model's config has no usable hidden_size for the value head")
    _decoder(model)  # fail before changing anything on a model without one
    try:
        model.add_adapter(CRITIC_ADAPTER, settings.to_peft_config())
    except ValueError as exc:  # e.g. critic.lora.targetModules matching no module
        raise AdapterError(f"critic.lora does not fit the base model: {exc}") from exc
    if not lora_parameters(model, CRITIC_ADAPTER):
        raise AdapterError("critic.lora matched no module of the base model")
    for _, p in lora_parameters(model, CRITIC_ADAPTER):
        p.requires_grad_(True)  # PEFT leaves a non-active adapter frozen
    device = next(p.device for _, p in lora_parameters(model, ADAPTER_NAME))
    head = nn.Linear(hidden, 1, dtype=torch.float32, device=device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model.add_module(VALUE_HEAD, head)
    setattr(model, CRITIC_FORWARD, types.MethodType(_critic_hidden, model))


def has_critic(model: nn.Module) -> bool:
    return isinstance(getattr(model, VALUE_HEAD, None), nn.Module)


def value_head(model: nn.Module) -> nn.Module:
    head = getattr(model, VALUE_HEAD, None)
    if not isinstance(head, nn.Module):
        raise ValueError("the model has no critic (add_critic was not called)")
    return head


def actor_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The actor's LoRA parameters, in a fixed order (the actor optimizer's param list)."""
    return lora_parameters(model, ADAPTER_NAME)


def critic_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The critic's LoRA parameters, then the value head's, in a fixed order."""
    head = [(f"{HEAD_PREFIX}{n}", p) for n, p in value_head(model).named_parameters()]
    return [*lora_parameters(model, CRITIC_ADAPTER), *head]


@contextmanager
def active_lora(model: nn.Module, adapter: str) -> Iterator[None]:
    """Route every LoRA layer through `adapter` for the block, restoring the previous one even
    on error. Unlike PEFT's `set_adapter` it leaves every `requires_grad` alone."""
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._active_adapter for m in layers]
    try:
        for m in layers:
            m._active_adapter = adapter
        yield
    finally:
        for m, prev in zip(layers, before, strict=True):
            m._active_adapter = prev


def _decoder(model: nn.Module) -> nn.Module:
    """The HF decoder inside the causal LM (`LlamaModel`, `GPT2Model`, ...): its output's first
    element is the last hidden state after the final norm."""
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    decoder = getattr(base, "base_model", base)
    if decoder is base:
        raise ValueError(f"cannot find the decoder inside {type(base).__name__}")
    return decoder


def _critic_hidden(
    self: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """The decoder's last hidden state (after its final norm): the LM head never runs.

    Bound to the model as `CRITIC_FORWARD`; `parallel.shard_model` registers it as an FSDP forward
    method, so the root's parameters (final norm, embeddings) are gathered around it and gathered
    again for its backward, as for `forward` (a plain call into the decoder would leave them
    resharded and the norm's backward would read freed storage).
    """
    out = _decoder(self)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    )
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def sequence_values(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Values [B, T] (fp32, zero outside `response_mask`): position t holds V(x_<t), the value of
    the state token t is generated in, read from the hidden state at t - 1 (aligned like
    logprobs).

    Runs the decoder only (no LM head, no other layer's activations kept in a no-grad pass), on
    each micro-batch's used columns (`logprobs.used_width`). Keeps the graph when grad is
    enabled; collective under FSDP2 like every forward. The actor is the active adapter again
    afterwards, even on error. `max_tokens` (training.maxTokensPerMicroBatch): micro-batches cut
    by the token budget too (`micro_batches`), rows shortest first, results in the rows' order.
    """
    check_shapes(input_ids, attention_mask, response_mask, micro_batch_size)
    head = value_head(model)
    hidden_of = getattr(model, CRITIC_FORWARD)
    n = input_ids.shape[0]
    if max_tokens is None:
        plan = [(torch.arange(s, min(s + micro_batch_size, n)), 1.0)
                for s in range(0, n, micro_batch_size)]  # fmt: skip
    else:
        lengths = row_lengths(attention_mask, response_mask)
        order = sorted(range(n), key=lambda i: lengths[i])
        micros = token_micro_batches([lengths[i] for i in order], max_tokens, micro_batch_size)
        plan = [(torch.tensor([order[p] for p in m.rows]), m.weight) for m in micros]
    values: list[torch.Tensor] = []
    rows_done: list[torch.Tensor] = []
    with active_lora(model, CRITIC_ADAPTER):
        for rows, weight in plan:
            rows = rows.to(input_ids.device)
            resp = response_mask[rows]
            width = used_width(attention_mask[rows], resp)
            ids, am = input_ids[rows, :width], attention_mask[rows, :width]
            first = first_scored_position(resp[:, :width])
            hidden = hidden_of(ids, am, position_ids_from_mask(am))
            v = head(hidden[:, first - 1 : -1].float()).squeeze(-1)
            v = torch.cat([v.new_zeros(v.shape[0], first), v], dim=1)
            v = F.pad(v, (0, input_ids.shape[1] - width))  # back to the batch's width
            if weight == 0:  # a filler, run only to match the other ranks' collectives
                continue
            values.append(torch.where(resp.bool(), v, 0.0))
            rows_done.append(rows)
    back = torch.argsort(torch.cat(rows_done))
    return torch.cat(values)[back]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def critic_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """Full critic tensors on CPU: its LoRA in PEFT file names plus `value_head.weight/bias`.
    Collective under FSDP2 (every rank calls it)."""
    tensors = lora_state_dict(model, CRITIC_ADAPTER)
    for name, p in value_head(model).named_parameters():
        tensors[f"{HEAD_PREFIX}{name}"] = _full(p.detach()).cpu().contiguous()
    return tensors


def split_critic_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(critic LoRA tensors, value head tensors without the `value_head.` prefix)."""
    lora = {k: v for k, v in tensors.items() if not k.startswith(HEAD_PREFIX)}
    head = {k.removeprefix(HEAD_PREFIX): v for k, v in tensors.items() if k.startswith(HEAD_PREFIX)}
    return lora, head


def set_critic_state_dict(model: PeftModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy full critic tensors (`critic_state_dict`'s form) into the possibly sharded model;
    every rank holds the same full tensors."""
    lora, head = split_critic_tensors(tensors)
    params = dict(value_head(model).named_parameters())
    if set(head) != set(params):
        raise AdapterError(
            f"value head tensors {sorted(head)} do not fit the model's {sorted(params)}"
        )
    set_lora_state_dict(model, lora, CRITIC_ADAPTER)
    for name, t in head.items():
        copy_full_into(params[name], t, f"{HEAD_PREFIX}{name}")


# ---------------------------------------------------------------- files

CRITIC_HEAD_FILE = "value_head.safetensors"
CRITIC_INFO_FILE = "critic.json"
CRITIC_FILES = (ADAPTER_WEIGHTS, ADAPTER_CONFIG, CRITIC_HEAD_FILE, CRITIC_INFO_FILE)


def critic_config(model: PeftModel) -> LoraConfig:
    return lora_config(model, CRITIC_ADAPTER)


def write_critic_dir(tensors: Mapping[str, torch.Tensor], config: LoraConfig, out: Path) -> None:
    """A PEFT adapter folder for the critic's LoRA, plus `value_head.safetensors` and a
    `critic.json` that says what the folder is (the adapter alone is not a policy)."""
    lora, head = split_critic_tensors(tensors)
    write_adapter_dir(lora, config, out)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in head.items()},
        str(out / CRITIC_HEAD_FILE),
        metadata={"format": "pt"},
    )
    weight = head.get("weight")
    info = {
        "what": "PPO critic: a LoRA adapter on the base model plus a value head",
        "value_head": {
            "file": CRITIC_HEAD_FILE,
            "in_features": int(weight.shape[1]) if weight is not None else None,
            "input": "last hidden state of the base decoder (after its final norm), critic "
            "adapter active; value of the state before token t is read at position t - 1",
        },
        "not_a_policy": "load the actor adapter folder to generate; this one scores states",
    }
    (out / CRITIC_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))


def read_critic_dir(path: Path) -> dict[str, torch.Tensor]:
    """The tensors `write_critic_dir` wrote, in `critic_state_dict`'s form."""
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    for name, t in load_file(str(path / CRITIC_HEAD_FILE)).items():
        tensors[f"{HEAD_PREFIX}{name}"] = t
    return tensors
