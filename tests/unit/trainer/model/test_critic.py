"""The PPO critic on the actor's base (trainer/model/critic.py) in one plain process: two PEFT
adapters
and a value head, what each touches, and how they are saved and exported."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config

from harness.workloads.tiny_models import make_tiny_model, tiny_config
from lorarl.trainer.checkpoint.export import export_final
from lorarl.trainer.checkpoint.manager import CheckpointError, CheckpointManager
from lorarl.trainer.fleet.publish import gather_adapter
from lorarl.trainer.model.critic import (
    CRITIC_ADAPTER,
    actor_parameters,
    add_critic,
    critic_parameters,
    critic_state_dict,
    has_critic,
    sequence_values,
    set_critic_state_dict,
)
from lorarl.trainer.model.loading import (
    ADAPTER_NAME,
    AdapterError,
    LoraSettings,
    apply_lora,
    load_base_model,
)
from lorarl.trainer.model.logprobs import reference_logprobs, sequence_logprobs, snapshot_lora

LORA = LoraSettings(rank=4, alpha=8)
CRITIC_LORA = LoraSettings(rank=2, alpha=4, target_modules=["q_proj", "v_proj", "down_proj"])


def _base(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=128, n_positions=64)
        return AutoModelForCausalLM.from_config(cfg).float()
    return AutoModelForCausalLM.from_config(tiny_config(arch)).float()


def _settings(arch: str) -> tuple[LoraSettings, LoraSettings]:
    if arch == "gpt2":  # GPT-2's projections are Conv1D, named c_attn / c_proj / c_fc
        return LoraSettings(rank=4, alpha=8, target_modules=["c_attn", "c_fc"]), LoraSettings(
            rank=2, alpha=4, target_modules=["c_attn"]
        )
    return LORA, CRITIC_LORA


def _randomise(params, seed: int, scale: float = 0.05) -> None:
    """Non-zero LoRA B and value head, so both adapters change the outputs and get gradients."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in params:
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def _model(arch: str = "llama", seed: int = 0, randomise: bool = True) -> PeftModel:
    actor, critic = _settings(arch)
    model = apply_lora(_base(arch, seed), actor)
    add_critic(model, critic)
    if randomise:
        _randomise(actor_parameters(model), seed + 1)
        _randomise(critic_parameters(model), seed + 2)
    return model


def _batch(seed: int = 0, batch: int = 3, length: int = 10, prompt: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, length), generator=g)
    attn = torch.ones(batch, length, dtype=torch.long)
    attn[0, :2] = 0  # a left-padded row
    resp = torch.zeros(batch, length, dtype=torch.long)
    resp[:, prompt:] = 1
    resp[1, -2:] = 0  # a shorter completion
    return ids, attn, resp


def _flags(model) -> dict[str, bool]:
    return {n: p.requires_grad for n, p in model.named_parameters()}


def _active(model) -> set[str]:
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    return {a for m in layers for a in m.active_adapters}


def test_add_critic_keeps_both_adapters_and_the_head_trainable_and_apart():
    model = _model(randomise=False)
    actor, critic = actor_parameters(model), critic_parameters(model)
    assert actor and all(f".{ADAPTER_NAME}." in n for n, _ in actor)
    assert [n for n, _ in critic][-2:] == ["value_head.weight", "value_head.bias"]
    assert all(f".{CRITIC_ADAPTER}." in n for n, _ in critic[:-2])
    assert not {id(p) for _, p in actor} & {id(p) for _, p in critic}
    assert all(p.requires_grad for _, p in actor + critic)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in actor} | {f"value_head.{k}" for k in ("weight", "bias")} | {
        n for n, _ in critic[:-2]
    }
    head = model.value_head
    assert head.weight.dtype == torch.float32 and not head.weight.any() and not head.bias.any()
    assert has_critic(model) and _active(model) == {ADAPTER_NAME}
    with pytest.raises(ValueError, match="already has a critic"):
        add_critic(model, CRITIC_LORA)


def test_a_critic_lora_that_fits_no_module_is_a_named_error():
    model = apply_lora(_base("llama"), LORA)
    with pytest.raises(AdapterError, match=r"critic\.lora does not fit"):
        add_critic(model, LoraSettings(rank=2, alpha=4, target_modules=["no_such_proj"]))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_values_are_the_head_on_the_normed_last_hidden_state_shifted_by_one(arch):
    model = _model(arch)
    ids, attn, resp = _batch()
    with torch.no_grad():
        values = sequence_values(model, ids, attn, resp, micro_batch_size=2)
        # Independent path: HF's own hidden_states output (its last entry is after the final
        # norm), with only the critic adapter switched on through PEFT itself.
        ref = copy.deepcopy(model)
        ref.base_model.set_adapter(CRITIC_ADAPTER)
        out = ref(input_ids=ids, attention_mask=attn, output_hidden_states=True,
                  position_ids=(attn.cumsum(-1) - 1).clamp(min=0))  # fmt: skip
        v = ref.value_head(out.hidden_states[-1]).squeeze(-1)
    want = torch.zeros_like(values)
    want[:, 1:] = v[:, :-1]
    want = torch.where(resp.bool(), want, 0.0)
    assert values.dtype == torch.float32 and values.shape == ids.shape
    assert (values - want).abs().max().item() < 1e-5
    assert values[resp.bool()].abs().min() > 0 and not values[~resp.bool()].any()
    assert _active(model) == {ADAPTER_NAME}
    with torch.no_grad():  # the critic adapter matters, the actor adapter does not
        with model.disable_adapter():
            pass
        _randomise(actor_parameters(model), 99)
        same = sequence_values(model, ids, attn, resp, micro_batch_size=3)
        _randomise(critic_parameters(model)[:-2], 98)
        moved = sequence_values(model, ids, attn, resp, micro_batch_size=3)
    assert (same - values).abs().max().item() < 1e-5
    assert (moved - values).abs().max().item() > 1e-4


def test_value_and_actor_losses_reach_only_their_own_parameters():
    model = _model()
    ids, attn, resp = _batch()
    actor, critic = actor_parameters(model), critic_parameters(model)
    sequence_values(model, ids, attn, resp, micro_batch_size=2).pow(2).sum().backward()
    assert all(p.grad is None or not p.grad.any() for _, p in actor)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in critic)
    model.zero_grad(set_to_none=True)
    lp, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=2)
    lp.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in actor)
    assert all(p.grad is None or not p.grad.any() for _, p in critic)


def test_the_critic_pass_never_touches_requires_grad_and_restores_the_actor_on_error():
    model = _model()
    ids, attn, resp = _batch()
    before = _flags(model)
    sequence_values(model, ids, attn, resp, micro_batch_size=2)
    assert _flags(model) == before
    with pytest.raises(IndexError):  # token id beyond the vocabulary: the embedding raises
        sequence_values(model, ids + 1000, attn, resp, micro_batch_size=2)
    assert _active(model) == {ADAPTER_NAME} and _flags(model) == before
    with pytest.raises(ValueError, match="response_mask shape"):
        sequence_values(model, ids, attn, resp[:, :-1], micro_batch_size=2)


def test_actor_logprobs_do_not_depend_on_the_critic():
    ids, attn, resp = _batch()
    with_critic = _model(randomise=False)
    _randomise(actor_parameters(with_critic), 1)
    _randomise(critic_parameters(with_critic), 2)
    torch.manual_seed(0)
    alone = apply_lora(_base("llama"), LORA)
    _randomise(actor_parameters(alone), 1)
    with torch.no_grad():
        a, _ = sequence_logprobs(with_critic, ids, attn, resp, micro_batch_size=2)
        b, _ = sequence_logprobs(alone, ids, attn, resp, micro_batch_size=2)
    assert (a - b).abs().max().item() < 1e-6
    assert gather_adapter(with_critic).keys() == gather_adapter(alone).keys()  # sync: actor only
    assert snapshot_lora(with_critic).keys() == snapshot_lora(alone).keys()
    for k, v in gather_adapter(alone).items():
        assert torch.equal(gather_adapter(with_critic)[k], v)


def test_reference_disables_both_adapters_and_leaves_both_trainable():
    model = _model()
    plain = _base("llama")
    ids, attn, resp = _batch()
    before = _flags(model)
    ref = reference_logprobs(model, ids, attn, resp, micro_batch_size=2)
    with torch.no_grad():
        want, _ = sequence_logprobs(plain, ids, attn, resp, micro_batch_size=2)
    assert (ref - want).abs().max().item() < 1e-5
    assert _flags(model) == before and all(p.requires_grad for _, p in critic_parameters(model))


def test_critic_state_dict_round_trip_and_mismatch():
    src, dst = _model(seed=0), _model(seed=0, randomise=False)
    tensors = critic_state_dict(src)
    assert {"value_head.weight", "value_head.bias"} <= tensors.keys()
    assert not any(".critic." in k or ".default." in k for k in tensors)
    set_critic_state_dict(dst, tensors)
    for k, v in critic_state_dict(dst).items():
        assert torch.equal(v, tensors[k]), k
    with pytest.raises(AdapterError, match="value head"):
        set_critic_state_dict(dst, {k: v for k, v in tensors.items() if k != "value_head.bias"})
    with pytest.raises(AdapterError, match="'critic' LoRA tensors do not fit"):
        set_critic_state_dict(dst, {k: v for i, (k, v) in enumerate(tensors.items()) if i})


def test_checkpoint_holds_the_critic_and_its_optimizer(tmp_path):
    model = _model()
    actor_opt = torch.optim.AdamW([p for _, p in actor_parameters(model)], lr=1e-3)
    critic_opt = torch.optim.AdamW([p for _, p in critic_parameters(model)], lr=1e-3)
    ids, attn, resp = _batch()
    for _ in range(2):
        loss = sequence_values(model, ids, attn, resp, micro_batch_size=3).sub(1).pow(2).sum()
        lp, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=3)
        (loss + lp.sum()).backward()
        actor_opt.step(), critic_opt.step()
        actor_opt.zero_grad(), critic_opt.zero_grad()
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(2, model, actor_opt, {"x": 1}, critic_optimizer=critic_opt)
    files = ["adapter_model.safetensors", "adapter_config.json", "value_head.safetensors"]
    for name in [*(f"critic/{f}" for f in [*files, "critic.json"]), "critic_optimizer.pt"]:
        assert (path / name).is_file(), name
    assert manager.verify(path) is None

    fresh = _model(seed=0, randomise=False)  # the same base, other adapter tensors
    _randomise(actor_parameters(fresh), 7)
    _randomise(critic_parameters(fresh), 8)
    fresh_actor = torch.optim.AdamW([p for _, p in actor_parameters(fresh)], lr=1e-3)
    fresh_critic = torch.optim.AdamW([p for _, p in critic_parameters(fresh)], lr=1e-3)
    loaded = manager.load(path, fresh, fresh_actor, fresh_critic)
    assert loaded.step == 2
    for k, v in critic_state_dict(model).items():
        assert torch.equal(critic_state_dict(fresh)[k], v), k
    # One more identical step on both: equal only if both optimizers' moments came back.
    for m, opts in ((model, (actor_opt, critic_opt)), (fresh, (fresh_actor, fresh_critic))):
        loss = sequence_values(m, ids, attn, resp, micro_batch_size=3).sub(1).pow(2).sum()
        lp, _ = sequence_logprobs(m, ids, attn, resp, micro_batch_size=3)
        (loss + lp.sum()).backward()
        for o in opts:
            o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)

    no_critic = apply_lora(_base("llama"), LORA)
    manager.load(path, no_critic, None)  # a critic the job does not use is ignored
    plain_opt = torch.optim.AdamW([p for _, p in actor_parameters(no_critic)], lr=1e-3)
    plain = CheckpointManager(tmp_path / "plain").save(1, no_critic, plain_opt, {})
    with pytest.raises(CheckpointError, match="has no critic"):
        manager.load(plain, fresh, None)


def test_export_writes_the_critic_beside_a_plain_peft_adapter(tmp_path):
    base_dir = make_tiny_model(tmp_path / "base")
    model = apply_lora(load_base_model(base_dir), LORA)
    add_critic(model, CRITIC_LORA)
    _randomise(actor_parameters(model), 1)
    _randomise(critic_parameters(model), 2)
    job = SimpleNamespace(spec=SimpleNamespace(training=SimpleNamespace(export=["adapter"])))
    adapter_dir = export_final(model, job, None, tmp_path / "out" / "adapter")
    critic_dir = tmp_path / "out" / "critic"
    ids, attn, resp = _batch()
    actor = PeftModel.from_pretrained(load_base_model(base_dir), str(adapter_dir))
    assert not any(".critic." in n for n, _ in actor.named_parameters())
    with torch.no_grad():
        got, _ = sequence_logprobs(actor, ids, attn, resp, micro_batch_size=3)
        want, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=3)
    assert (got - want).abs().max().item() < 1e-5
    # The critic folder: a PEFT adapter + value head that reproduce the trainer's values.
    info = json.loads((critic_dir / "critic.json").read_text())
    assert info["value_head"]["in_features"] == 128
    critic = PeftModel.from_pretrained(load_base_model(base_dir), str(critic_dir))
    head = torch.nn.Linear(128, 1)
    head.load_state_dict(load_file(str(critic_dir / "value_head.safetensors")))
    with torch.no_grad():
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = critic(
            input_ids=ids, attention_mask=attn, position_ids=pos, output_hidden_states=True
        )
        hidden = out.hidden_states[-1]
        v = head(hidden).squeeze(-1)
        values = sequence_values(model, ids, attn, resp, micro_batch_size=3)
    assert (torch.where(resp[:, 1:].bool(), v[:, :-1], 0.0) - values[:, 1:]).abs().max() < 1e-5
