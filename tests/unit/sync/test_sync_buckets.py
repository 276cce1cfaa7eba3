"""Wire packing: exact round trips, bucket bounds, header JSON, and update validation."""

from __future__ import annotations

import pydantic
import pytest
import torch

from lorarl.sync.buckets import (
    ALIGN,
    BucketSpec,
    SyncHeader,
    TensorEntry,
    check_layout,
    pack,
    unpack,
    unpack_all,
    validate_update,
)
from lorarl.sync.errors import UpdateValidationError

Q = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"
BASE_SHAPES = {Q: (8, 6), DOWN: (6, 10)}  # module -> (out, in)


def lora(module: str, part: str) -> str:
    return f"base_model.model.{module}.lora_{part}.weight"


def header(**overrides) -> SyncHeader:
    fields = dict(
        version=3, mode="merged", scaling=2.0, rank=2, alpha=4.0, use_rslora=False,
        target_modules=(Q, DOWN),
    )  # fmt: skip
    fields.update(overrides)
    return SyncHeader(**fields)


def good_update() -> dict[str, torch.Tensor]:
    return {
        lora(Q, "A"): torch.randn(2, 6),
        lora(Q, "B"): torch.randn(8, 2),
        lora(DOWN, "A"): torch.randn(2, 10),
        lora(DOWN, "B"): torch.randn(6, 2),
    }


def test_round_trip_is_bit_exact_for_every_dtype():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, generator=g).bfloat16(),
        "f16": torch.randn(2, 3, 1, generator=g).half(),
        "transposed": torch.randn(4, 3, generator=g).t(),  # non-contiguous input
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    buckets = pack(tensors, bucket_bytes=64)
    assert len(buckets) >= 2
    out = {}
    for b in buckets:
        assert b.buffer.dtype == torch.uint8 and b.buffer.numel() == b.spec.nbytes
        out.update(unpack(b.buffer, b.spec.entries))
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_buckets_are_bounded_and_aligned():
    tensors = {f"t{i}": torch.full((25,), float(i)) for i in range(5)}  # 100 bytes each
    buckets = pack(tensors, bucket_bytes=250)
    # 0..100, 112..212 fit; the third would end at 324 > 250.
    assert [[e.name for e in b.spec.entries] for b in buckets] == [
        ["t0", "t1"], ["t2", "t3"], ["t4"],
    ]  # fmt: skip
    for b in buckets:
        assert b.spec.nbytes <= 250
        assert all(e.offset % ALIGN == 0 for e in b.spec.entries)
    assert [e.offset for e in buckets[0].spec.entries] == [0, 112]


def test_oversized_tensor_gets_its_own_bucket():
    tensors = {"a": torch.zeros(10), "big": torch.zeros(1000), "c": torch.zeros(10)}
    buckets = pack(tensors, bucket_bytes=256)
    assert [[e.name for e in b.spec.entries] for b in buckets] == [["a"], ["big"], ["c"]]
    assert buckets[1].spec.nbytes == 4000
    with pytest.raises(ValueError, match="bucket_bytes"):
        pack(tensors, bucket_bytes=0)


def test_unpack_views_share_the_buffer_copies_do_not():
    (bucket,) = pack({"x": torch.ones(4)}, bucket_bytes=1 << 20)
    view = unpack(bucket.buffer, bucket.spec.entries)["x"]
    copy = unpack(bucket.buffer, bucket.spec.entries, copy=True)["x"]
    bucket.buffer.zero_()
    assert view.tolist() == [0.0] * 4
    assert copy.tolist() == [1.0] * 4


def test_unpack_rejects_entries_outside_the_bucket():
    entry = TensorEntry(name="w", shape=(4,), dtype="float32", offset=8, numel=4)
    with pytest.raises(UpdateValidationError, match=r"'w'.*exceed the bucket \(16 bytes\)"):
        unpack(torch.zeros(16, dtype=torch.uint8), [entry])
    bad_shape = TensorEntry(name="v", shape=(3,), dtype="float32", offset=0, numel=4)
    with pytest.raises(UpdateValidationError, match="'v'"):
        unpack(torch.zeros(16, dtype=torch.uint8), [bad_shape])


def _entry(name: str, offset: int, shape=(4,), numel=4, dtype="float32") -> TensorEntry:
    return TensorEntry(name=name, shape=shape, dtype=dtype, offset=offset, numel=numel)


@pytest.mark.parametrize(
    ("entries", "nbytes", "message"),
    [
        ([_entry("w", 1)], 32, "'w': offset 1 is not a multiple of float32's size"),
        ([_entry("w", 0), _entry("v", 8)], 32, "'v' overlaps 'w'"),
        ([_entry("w", 0, shape=(8,)), _entry("v", 4, shape=(1,), numel=1)], 64, "'w': shape"),
        ([_entry("w", 0, shape=(16,), numel=16), _entry("v", 16)], 64, "'v' overlaps 'w'"),
        ([_entry("w", 0), _entry("w", 16)], 32, "'w' appears twice"),
    ],
)
def test_a_layout_that_does_not_fit_its_bucket_is_refused_before_any_view(entries, nbytes, message):
    """A header is checked before the buckets arrive: a lie is an error naming the tensor,
    never an exception from `view()` later."""
    h = header(buckets=(BucketSpec(nbytes=nbytes, entries=tuple(entries)),))
    with pytest.raises(UpdateValidationError, match=message):
        check_layout(h)
    with pytest.raises(UpdateValidationError):
        unpack_all([torch.zeros(nbytes, dtype=torch.uint8)], h)
    check_layout(header(buckets=(BucketSpec(nbytes=32, entries=(_entry("w", 0),)),)))
    with pytest.raises(pydantic.ValidationError, match="shape"):
        _entry("w", 0, shape=(-2, -2))


def test_header_json_round_trip_and_bad_fields():
    tensors = good_update()
    buckets = pack(tensors, bucket_bytes=64)
    h = header().with_buckets(buckets)
    again = SyncHeader.from_bytes(h.to_bytes())
    assert again == h
    assert again.payload_bytes == sum(b.spec.nbytes for b in buckets)
    out = unpack_all([b.buffer for b in buckets], again)
    assert all(torch.equal(out[k], v) for k, v in tensors.items())
    with pytest.raises(UpdateValidationError, match="got 1 buckets"):
        unpack_all([buckets[0].buffer], again)
    with pytest.raises(pydantic.ValidationError, match="int8"):
        TensorEntry(name="w", shape=(1,), dtype="int8", offset=0, numel=1)
    with pytest.raises(pydantic.ValidationError, match="mode"):
        header(mode="full")


def test_valid_update_passes():
    h = header().with_buckets(pack(good_update(), bucket_bytes=64))
    validate_update(h, BASE_SHAPES, expected_rank=2)
    # a receiver that cannot read the adapter (spec.lora.rank unset): the header's rank
    validate_update(h, BASE_SHAPES, expected_rank=None)
    with pytest.raises(UpdateValidationError, match="shape"):
        validate_update(h.model_copy(update={"rank": 4}), BASE_SHAPES, expected_rank=None)


@pytest.mark.parametrize(
    ("mutate", "header_overrides", "expected_rank", "message"),
    [
        (
            lambda t: t.__setitem__(lora(Q, "A"), torch.randn(2, 7)),
            {}, 2,
            r"lora_A\.weight'.*shape \[2, 7\].*\[out=8, in=6\].*\[r, in\] = \[2, 6\]",
        ),
        (
            lambda t: t.__setitem__(lora(DOWN, "B"), torch.randn(10, 2)),
            {}, 2,
            r"down_proj\.lora_B\.weight'.*must be \[out, r\] = \[6, 2\]",
        ),
        (
            lambda t: t.update({lora("model.layers.5.mlp.up_proj", p): torch.zeros(2, 2)
                                for p in "AB"}),
            {"target_modules": (Q, DOWN, "model.layers.5.mlp.up_proj")}, 2,
            r"module 'model\.layers\.5\.mlp\.up_proj' is not in the base model",
        ),
        (lambda t: None, {}, 4, r"header rank 2 != expected rank 4"),
        (lambda t: t.pop(lora(Q, "B")), {}, 2, r"module '.*q_proj': only lora_A was sent"),
        (lambda t: None, {"scaling": 1.0}, 2, r"header scaling 1\.0 != 2\.0"),
        (lambda t: None, {"target_modules": (Q,)}, 2, r"not in header\.target_modules"),
        (
            lambda t: t.__setitem__("base_model.model.x.qkv_proj.lora_A.weight", torch.zeros(1)),
            {}, 2, r"qkv_proj.*fused",
        ),
    ],
)  # fmt: skip
def test_invalid_updates_are_named(mutate, header_overrides, expected_rank, message):
    tensors = good_update()
    mutate(tensors)
    h = header(**header_overrides).with_buckets(pack(tensors, bucket_bytes=64))
    with pytest.raises(UpdateValidationError, match=message) as info:
        validate_update(h, BASE_SHAPES, expected_rank=expected_rank)
    assert "update v3 rejected" in str(info.value)
