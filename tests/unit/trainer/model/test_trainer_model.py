"""Single-process tests of the trainer's model side: loading, LoRA, logprobs, parallel helpers."""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import make_tiny_model, tiny_config
from lorarl.local.ports import free_port
from lorarl.trainer.model.loading import (
    AdapterError,
    LoraSettings,
    ModelLoadError,
    apply_lora,
    count_parameters,
    load_base_model,
    lora_config,
    lora_parameters,
    lora_settings,
    lora_state_dict,
    set_lora_state_dict,
)
from lorarl.trainer.model.logprobs import reference_logprobs, sequence_logprobs
from lorarl.trainer.model.parallel import (
    clip_grad_norm,
    decoder_layers,
    init_distributed,
    set_gradient_sync,
    shard_model,
    shutdown_distributed,
)

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def arch_model(request, tmp_path_factory):
    return request.param, make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama")


def expected_lora_params(arch: str, rank: int, suffixes=LINEAR_SUFFIXES) -> int:
    """r * (in + out) for every adapted projection, from the config's shapes."""
    c = tiny_config(arch)
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    dims = {
        "q_proj": (c.hidden_size, q_out),
        "k_proj": (c.hidden_size, kv_out),
        "v_proj": (c.hidden_size, kv_out),
        "o_proj": (q_out, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }
    return c.num_hidden_layers * sum(rank * sum(dims[s]) for s in suffixes)


# ------------------------------------------------------------------ loading


def test_load_base_model_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match=str(missing)):
        load_base_model(missing)


def test_load_base_model_without_config_names_path(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*config\.json"):
        load_base_model(tmp_path)


def test_load_base_model_rejects_unknown_dtype(llama_dir):
    with pytest.raises(ValueError, match=r"model\.dtype"):
        load_base_model(llama_dir, dtype="float8")  # type: ignore[arg-type]


def test_load_base_model_dtype(llama_dir):
    model = load_base_model(llama_dir, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_the_lm_head_gets_a_contiguous_input_and_the_same_logits(arch_model):
    """`logits_to_keep` slices a non-contiguous view; the head must see a contiguous copy (else
    F.linear broadcasts the whole head weight per sample) and score exactly the same."""
    _, model_dir = arch_model
    hooked = apply_lora(load_base_model(model_dir), LoraSettings(rank=4, alpha=8))
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    seen: list[bool] = []
    hooked.get_output_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(args[0].is_contiguous())
    )
    ids = torch.randint(3, tiny_config("llama").vocab_size, (3, 9), generator=torch.Generator())
    with torch.no_grad():
        got = hooked(input_ids=ids, logits_to_keep=4).logits
        want = plain(input_ids=ids, logits_to_keep=4).logits
    assert seen == [True]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------ LoRA


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("lora.rank", {"rank": 0}),
        ("lora.alpha", {"alpha": -1}),
        ("lora.dropout", {"dropout": 1.0}),
        ("lora.targetModules", {"target_modules": []}),
        ("lora.targetModules", {"target_modules": "all-linearish"}),
    ],
)
def test_lora_settings_validation_names_field(field, kwargs):
    with pytest.raises(ValueError, match=re.escape(field)):
        LoraSettings(**kwargs)


def test_apply_lora_only_lora_trainable(arch_model):
    arch, model_dir = arch_model
    model = apply_lora(load_base_model(model_dir), LoraSettings(rank=4, alpha=8))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n for n in trainable)  # all-linear skips the output head
    n_train, n_total = count_parameters(model)
    assert n_train == expected_lora_params(arch, 4)
    assert n_total == n_train + sum(p.numel() for p in load_base_model(model_dir).parameters())


def test_apply_lora_target_list_and_exclude(llama_dir):
    settings = LoraSettings(
        rank=2, alpha=4, target_modules=["q_proj", "v_proj", "o_proj"], exclude_modules=["o_proj"]
    )
    model = apply_lora(load_base_model(llama_dir), settings)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in lora_parameters(model)}
    assert adapted == {"q_proj", "v_proj"}
    assert count_parameters(model)[0] == expected_lora_params("llama", 2, ("q_proj", "v_proj"))


def test_lora_state_dict_is_peft_named(llama_dir):
    model = apply_lora(load_base_model(llama_dir), LoraSettings(rank=4, alpha=8))
    ours = lora_state_dict(model)
    theirs = get_peft_model_state_dict(model)
    assert ours.keys() == theirs.keys()
    assert all(".default." not in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_set_lora_state_dict_round_trip_and_mismatch(llama_dir):
    settings = LoraSettings(rank=4, alpha=8)
    torch.manual_seed(1)
    src = apply_lora(load_base_model(llama_dir), settings)
    torch.manual_seed(2)
    dst = apply_lora(load_base_model(llama_dir), settings)
    tensors = {k: v + 0.5 for k, v in lora_state_dict(src).items()}
    set_lora_state_dict(dst, tensors)
    got = lora_state_dict(dst)
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    first = next(iter(tensors))
    with pytest.raises(AdapterError, match="missing"):
        set_lora_state_dict(dst, {k: v for k, v in tensors.items() if k != first})
    with pytest.raises(AdapterError, match="shape"):
        set_lora_state_dict(dst, {**tensors, first: torch.zeros(1, 1)})


@pytest.fixture(scope="module")
def saved_adapter(llama_dir, tmp_path_factory):
    """A rank-4 adapter written by PEFT itself with an explicit suffix list."""
    out = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(3)
    model = get_peft_model(
        load_base_model(llama_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=list(LINEAR_SUFFIXES)),
    )
    for _, p in lora_parameters(model):
        torch.nn.init.normal_(p)
    model.save_pretrained(out)
    return out, get_peft_model_state_dict(model)


def test_adapter_path_rank_mismatch_names_both(llama_dir, saved_adapter):
    path, _ = saved_adapter
    settings = LoraSettings(rank=8, alpha=8, adapter_path=str(path))
    with pytest.raises(AdapterError, match=r"rank 4 but lora.rank is 8"):
        apply_lora(load_base_model(llama_dir), settings)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 16}, "alpha 8"),
        ({"use_rslora": True}, "use_rslora"),
        ({"target_modules": ["q_proj"]}, "targets different modules"),
    ],
)
def test_adapter_path_other_mismatches(llama_dir, saved_adapter, kwargs, message):
    path, _ = saved_adapter
    settings = LoraSettings(**{"rank": 4, "alpha": 8, "adapter_path": str(path), **kwargs})
    with pytest.raises(AdapterError, match=message):
        apply_lora(load_base_model(llama_dir), settings)


def test_adapter_path_missing_config(llama_dir, tmp_path):
    with pytest.raises(AdapterError, match=rf"{tmp_path}.*adapter_config.json"):
        apply_lora(load_base_model(llama_dir), LoraSettings(rank=4, adapter_path=str(tmp_path)))


def test_adapter_path_resumes_weights_trainable(llama_dir, saved_adapter):
    path, weights = saved_adapter
    # "all-linear" and the explicit list of all seven projections adapt the same modules
    model = apply_lora(
        load_base_model(llama_dir), LoraSettings(rank=4, alpha=8, adapter_path=str(path))
    )
    got = lora_state_dict(model)
    assert got.keys() == weights.keys()
    assert all(torch.equal(got[k], weights[k]) for k in got)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in lora_parameters(model)}


def _job_with_lora(lora: dict):
    from lorarl.api import LoRARLJob

    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1", "kind": "LoRARLJob",
        "metadata": {"name": "job", "namespace": "ml"},
        "spec": {"model": {"path": "/models/m"}, "data": {"trainFiles": ["t.jsonl"]},
                 "lora": lora},
    })  # fmt: skip


def test_adapter_path_supplies_the_settings_the_spec_leaves_unset(llama_dir, saved_adapter):
    path, weights = saved_adapter
    settings = lora_settings(_job_with_lora({"adapterPath": str(path)}))
    assert (settings.rank, settings.alpha, settings.use_rslora) == (4, 8.0, False)
    assert settings.target_modules == sorted(LINEAR_SUFFIXES)
    model = apply_lora(load_base_model(llama_dir), settings)
    assert lora_config(model).r == 4
    got = lora_state_dict(model)
    assert all(torch.equal(got[k], weights[k]) for k in weights)
    # the same values written out are no conflict
    same = {"adapterPath": str(path), "rank": 4, "alpha": 8, "useRslora": False}
    assert lora_settings(_job_with_lora(same)) == settings


def test_adapter_path_conflict_with_a_set_field_names_it_and_both_values(saved_adapter):
    path, _ = saved_adapter
    with pytest.raises(
        AdapterError, match=rf"^spec.lora.rank: 16 but the adapter at {path} says r=4$"
    ):
        lora_settings(_job_with_lora({"adapterPath": str(path), "rank": 16}))
    with pytest.raises(AdapterError, match=r"has no adapter_config.json"):
        lora_settings(_job_with_lora({"adapterPath": str(path / "missing")}))


def test_without_an_adapter_unset_fields_take_the_defaults():
    settings = lora_settings(_job_with_lora({}))
    assert settings == LoraSettings(rank=32, alpha=32.0, target_modules="all-linear")


# ------------------------------------------------------------------ logprobs


def _batch(seed: int = 0, batch: int = 3, length: int = 10, prompt: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 100, (batch, length), generator=g)
    attn = torch.ones_like(ids)
    resp = torch.zeros_like(ids)
    resp[:, prompt:] = 1
    return ids, attn, resp


def test_sequence_logprobs_matches_hand_computation(llama_dir):
    model = load_base_model(llama_dir)
    ids, attn, resp = _batch()
    lp, ent = sequence_logprobs(model, ids, attn, resp, micro_batch_size=2, with_entropy=True)
    assert lp.shape == ids.shape and lp.dtype == torch.float32
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    for b, t in [(0, 4), (1, 7), (2, 9)]:
        dist = torch.log_softmax(logits[b, t - 1], -1)
        assert lp[b, t].item() == pytest.approx(dist[ids[b, t]].item(), abs=1e-5)
        assert ent[b, t].item() == pytest.approx(-(dist.exp() * dist).sum().item(), abs=1e-5)
    assert torch.all(lp[:, :4] == 0) and torch.all(ent[:, :4] == 0)
    assert torch.all(lp[:, 4:] < 0) and torch.all(ent[:, 4:] > 0)


def test_sequence_logprobs_micro_batch_and_left_padding_invariant(llama_dir):
    model = load_base_model(llama_dir)
    ids, attn, resp = _batch(batch=4)
    with torch.no_grad():
        full, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=4)
        ones, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=1)
        assert torch.allclose(full, ones, atol=1e-5)
        pad = 3  # the same row 0, left-padded: response logprobs must not move
        p_ids = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), ids[:1]], 1)
        p_attn = torch.cat([torch.zeros(1, pad, dtype=attn.dtype), attn[:1]], 1)
        p_resp = torch.cat([torch.zeros(1, pad, dtype=resp.dtype), resp[:1]], 1)
        padded, _ = sequence_logprobs(model, p_ids, p_attn, p_resp, micro_batch_size=1)
    assert torch.allclose(padded[0, pad:], full[0], atol=1e-5)


def _full_sequence_logprobs(model, ids, resp):
    """The reference: LM head over every position, then the mask."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    full = torch.cat([torch.zeros(ids.shape[0], 1), picked], 1)
    return torch.where(resp.bool(), full, 0.0)


class _HeadWatcher(torch.nn.Module):
    """Passes calls through and records the `logits_to_keep` each forward asked for."""

    def __init__(self, model, accept_keep: bool):
        super().__init__()
        self.model, self.kept = model, []
        if accept_keep:
            self.forward = self._with_keep
        else:
            self.forward = self._without_keep

    def _with_keep(self, input_ids, attention_mask, position_ids, use_cache, logits_to_keep=0):
        self.kept.append(logits_to_keep)
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=use_cache, logits_to_keep=logits_to_keep,
        )  # fmt: skip

    def _without_keep(self, input_ids, attention_mask, position_ids, use_cache):
        self.kept.append(None)
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            use_cache=use_cache,
        )  # fmt: skip


@pytest.mark.parametrize("accept_keep", [True, False])
def test_lm_head_runs_only_from_the_first_completion_position(llama_dir, accept_keep):
    """Rows whose completions start at different columns score exactly as full-sequence logits."""
    model = load_base_model(llama_dir)
    ids, attn, resp = _batch(batch=4, length=12)
    resp.zero_()
    for row, start in enumerate([7, 5, 9, 11]):
        resp[row, start:] = 1
    resp[3, -1] = 0  # a completion that ends before the padding does
    expected = _full_sequence_logprobs(model, ids, resp)
    watcher = _HeadWatcher(model, accept_keep)
    with torch.no_grad():
        got, ent = sequence_logprobs(
            watcher, ids, attn, resp, micro_batch_size=2, with_entropy=True
        )
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.all(got[resp.bool()] < 0) and torch.all(got[~resp.bool()] == 0)
    assert torch.all(ent[resp.bool()] > 0) and torch.all(ent[~resp.bool()] == 0)
    # micro-batch 0 first scores column 5, micro-batch 1 column 9: keep T - first + 1 logits
    assert watcher.kept == ([12 - 5 + 1, 12 - 9 + 1] if accept_keep else [None, None])


def test_a_micro_batch_without_completions_still_runs_the_model(llama_dir):
    """FSDP forwards are collective: a rank with nothing to score must still call the model."""
    model = load_base_model(llama_dir)
    watcher = _HeadWatcher(model, accept_keep=True)
    ids, attn, resp = _batch(batch=2)
    resp.zero_()
    with torch.no_grad():
        got, _ = sequence_logprobs(watcher, ids, attn, resp, micro_batch_size=2)
    assert watcher.kept == [1] and torch.all(got == 0)


def test_sequence_logprobs_rejects_bad_shapes(llama_dir):
    model = load_base_model(llama_dir)
    ids, attn, resp = _batch()
    with pytest.raises(ValueError, match="response_mask shape"):
        sequence_logprobs(model, ids, attn, resp[:, :-1], micro_batch_size=2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        sequence_logprobs(model, ids, attn, resp, micro_batch_size=0)


def test_reference_logprobs_is_base_model_exactly(llama_dir):
    base = load_base_model(llama_dir)
    model = apply_lora(load_base_model(llama_dir), LoraSettings(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in lora_parameters(model):
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn_like(p))
    ids, attn, resp = _batch()
    with torch.no_grad():
        plain, _ = sequence_logprobs(base, ids, attn, resp, micro_batch_size=2)
    ref = reference_logprobs(model, ids, attn, resp, micro_batch_size=2)
    assert torch.equal(ref, plain)
    assert not ref.requires_grad
    policy, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=2)
    assert policy.requires_grad
    assert (policy - plain).abs().max().item() > 1e-3
    # LoRA must still be trainable after the disabled-adapter pass
    assert all(p.requires_grad for _, p in lora_parameters(model))
    policy.sum().backward()
    assert all(p.grad is not None for _, p in lora_parameters(model))


# ------------------------------------------------------------------ parallel (single process)


def test_init_distributed_single_process_fallback():
    ctx = init_distributed(env={})
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.is_main) == (0, 1, None, True)


def test_init_distributed_partial_env_is_an_error():
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT missing"):
        init_distributed(env={"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})


def test_clip_grad_norm_hand_computed():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    norm = clip_grad_norm([a, b], max_norm=1.0)
    assert norm.item() == pytest.approx(5.0)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], abs=1e-6)
    assert b.grad.tolist() == pytest.approx([0.8], abs=1e-6)


def test_shard_model_one_rank_gloo_matches_unsharded(llama_dir, monkeypatch):
    """A real 1-rank gloo group: fully_shard wraps every layer, numerics are unchanged."""
    port = free_port()
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ids, attn, resp = _batch()
    torch.manual_seed(5)
    plain = apply_lora(load_base_model(llama_dir), LoraSettings(rank=4, alpha=8))
    with torch.no_grad():
        expected, _ = sequence_logprobs(plain, ids, attn, resp, micro_batch_size=2)
    torch.manual_seed(5)
    model = apply_lora(load_base_model(llama_dir), LoraSettings(rank=4, alpha=8))
    ctx = init_distributed(env)
    try:
        assert ctx.backend == "gloo" and ctx.world_size == 1
        shard_model(model, ctx, mixed_precision=True)
        assert all(type(m).__name__.startswith("FSDP") for m in decoder_layers(model))
        assert all(hasattr(p, "device_mesh") for p in model.parameters())
        set_gradient_sync(model, False)
        got, _ = sequence_logprobs(model, ids, attn, resp, micro_batch_size=2)
        set_gradient_sync(model, True)
        assert torch.allclose(got, expected, atol=1e-6)
        got.sum().backward()
        norm = clip_grad_norm([p for _, p in lora_parameters(model)], max_norm=1e9)
        assert norm.item() > 0
        ref = reference_logprobs(model, ids, attn, resp, micro_batch_size=2)
        assert all(p.requires_grad for _, p in lora_parameters(model))
        assert ref.shape == ids.shape
    finally:
        shutdown_distributed(ctx)


def test_decoder_layers_of_plain_and_peft_model(llama_dir):
    base = load_base_model(llama_dir)
    assert len(decoder_layers(base)) == 2
    peft_model = apply_lora(base, LoraSettings(rank=2, alpha=2))
    assert len(decoder_layers(peft_model)) == 2
    with pytest.raises(ValueError, match="decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))
