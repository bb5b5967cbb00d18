from __future__ import annotations

import math
import pickle
import re
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcore import codec
from fedcore.codec import (
    CHUNK_BYTES,
    DTYPES,
    Chunk,
    CodecError,
    EncodedTensor,
    Reassembler,
    all_finite,
    decode,
    encode,
    encoded_size,
    iter_chunks,
)

MiB = 1 << 20


def _sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("float"):
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def _roundtrip(array: np.ndarray | torch.Tensor, **kw: object) -> tuple[EncodedTensor, np.ndarray]:
    enc = encode(array, **kw)  # type: ignore[arg-type]
    return enc, decode("t", enc.dtype, enc.shape, enc.data)


def _stream(tensors: dict[str, np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    return [c for name, arr in tensors.items() for c in iter_chunks(name, encode(arr), 3, chunk_bytes)]


def _reassemble(chunks: list[Chunk], **kw: object) -> Reassembler:
    r = Reassembler(**kw)  # type: ignore[arg-type]
    for c in chunks:
        r.add(c)
    return r


@contextmanager
def _raises(tensor: str, kind: str) -> Iterator[pytest.ExceptionInfo[CodecError]]:
    """Expect a CodecError of ``kind`` whose message starts by naming ``tensor``."""
    with pytest.raises(CodecError, match=rf"^tensor '{re.escape(tensor)}': ") as exc:
        yield exc
    assert exc.value.tensor == tensor
    assert exc.value.kind == kind


# ----------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_round_trip_every_dtype(dtype: str, shape: tuple[int, ...]) -> None:
    a = _sample(dtype, shape)
    enc, out = _roundtrip(a)
    assert enc.dtype == dtype and enc.shape == shape
    assert enc.nbytes == len(enc.data) == encoded_size(shape, dtype) == a.size * DTYPES[dtype].itemsize
    assert out.dtype == np.dtype(dtype) and out.shape == shape
    np.testing.assert_array_equal(out, a)
    assert out.flags.writeable and out.flags.c_contiguous
    out[...] = 0  # a copy, not a view of the wire bytes


def test_wire_bytes_are_little_endian_c_order() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert encode(a).data == b"".join(int(v).to_bytes(4, "little") for v in a.ravel(order="C"))
    assert encode(a.T).data == b"".join(int(v).to_bytes(4, "little") for v in a.T.ravel(order="C"))


def test_non_contiguous_and_transposed_input() -> None:
    a = _sample("float64", (6, 8))
    for view in (a.T, a[::2, 1::3], np.asfortranarray(a)):
        enc, out = _roundtrip(view)
        assert enc.shape == view.shape
        np.testing.assert_array_equal(out, view)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "int32"])
def test_big_endian_input_is_converted(dtype: str) -> None:
    a = _sample(dtype, (4, 5))
    big = a.astype(np.dtype(dtype).newbyteorder(">"))
    assert encode(big).data == encode(a).data
    _, out = _roundtrip(big)
    assert out.dtype.isnative
    np.testing.assert_array_equal(out, a)


def test_torch_tensor_input() -> None:
    t = torch.randn(3, 4, requires_grad=True)
    enc, out = _roundtrip(t)
    assert enc.dtype == "float32"
    np.testing.assert_array_equal(out, t.detach().numpy())
    assert encode(torch.tensor([True, False])).dtype == "bool"
    assert encode(torch.arange(3)).dtype == "int64"


def test_unsupported_input_dtype_names_the_tensor() -> None:
    with _raises("c", "unsupported_dtype") as exc:
        encode(np.zeros(2, dtype=np.complex64), name="c")
    assert exc.value.kind == "unsupported_dtype"
    with _raises("b", "unsupported_dtype"):
        encode(torch.zeros(2, dtype=torch.bfloat16), name="b")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fp16_transport_round_trip(dtype: str) -> None:
    a = _sample(dtype, (16, 9)) * 10
    enc = encode(a, fp16=True)
    assert enc.dtype == "float16"
    assert enc.nbytes == a.size * 2 == encoded_size(a.shape, dtype, fp16=True)
    out = decode("w", enc.dtype, enc.shape, enc.data, expected_dtype=dtype)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_allclose(out, a, rtol=1e-3, atol=1e-4)  # float16 has an 11-bit significand


def test_fp16_leaves_other_dtypes_alone() -> None:
    for dtype in ("int64", "int32", "uint8", "bool", "float16"):
        a = _sample(dtype, (3,))
        enc = encode(a, fp16=True)
        assert enc.dtype == dtype
        assert encoded_size((3,), dtype, fp16=True) == enc.nbytes


def test_fp16_refuses_to_overflow_finite_values() -> None:
    with _raises("big", "fp16_overflow") as exc:
        encode(np.array([1.0, 1e6], dtype=np.float32), fp16=True, name="big")
    assert exc.value.kind == "fp16_overflow"
    # already-infinite values are not an overflow; the receiver decides about them
    enc = encode(np.array([np.inf, 65519.0], dtype=np.float32), fp16=True)
    assert np.isinf(np.frombuffer(enc.data, "<f2")[0])


def test_encoding_does_not_check_finiteness() -> None:
    enc = encode(np.array([np.nan, np.inf], dtype=np.float32))
    out = decode("t", enc.dtype, enc.shape, enc.data, allow_nonfinite=True)
    assert np.isnan(out[0]) and np.isinf(out[1])


def test_encoded_size_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="bfloat16"):
        encoded_size((2,), "bfloat16")


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
)
def test_a_torch_tensors_encoded_size_is_the_length_encode_writes(dtype: torch.dtype, fp16: bool) -> None:
    """A push's resume positions count these sizes: they must be the bytes encode writes, 0-d and empty too."""
    for shape in [(), (0, 3), (5, 2, 3)]:
        t = torch.zeros(shape, dtype=dtype)
        assert codec.tensor_encoded_size(t, fp16) == len(encode(t, fp16=fp16).data)


def test_a_torch_tensors_encoded_size_refuses_what_encode_refuses() -> None:
    with _raises("b", "unsupported_dtype"):
        codec.tensor_encoded_size(torch.zeros(2, dtype=torch.bfloat16), True, name="b")


# ----------------------------------------------------------------------------- decode rejections

GOOD = encode(np.arange(12, dtype=np.float32).reshape(3, 4))


def test_decode_truncated() -> None:
    with _raises("conv1.atoms", "truncated") as exc:
        decode("conv1.atoms", "float32", (3, 4), GOOD.data[:-1])
    assert exc.value.kind == "truncated" and "truncated" in exc.value.reason


def test_decode_oversized() -> None:
    with _raises("conv1.atoms", "oversized") as exc:
        decode("conv1.atoms", "float32", (3, 4), GOOD.data + b"\0")
    assert exc.value.kind == "oversized" and "oversized" in str(exc.value)


def test_decode_max_bytes() -> None:
    assert decode("w", "float32", (3, 4), GOOD.data, max_bytes=48).shape == (3, 4)
    with _raises("w", "too_large") as exc:
        decode("w", "float32", (3, 4), GOOD.data, max_bytes=47)
    assert exc.value.kind == "too_large"
    with _raises("w", "too_large"):  # a lying header is refused on its declared size too
        decode("w", "float32", (1 << 30,), b"", max_bytes=1000)


def test_decode_shape_mismatch_message() -> None:
    with _raises("fc.weight", "shape_mismatch") as exc:
        decode("fc.weight", "float32", (3, 4), GOOD.data, expected_shape=(4, 3))
    assert str(exc.value) == "tensor 'fc.weight': shape (3, 4) does not match expected (4, 3)"
    assert exc.value.tensor == "fc.weight" and exc.value.kind == "shape_mismatch"


def test_decode_wrong_dtype() -> None:
    enc = encode(np.arange(12, dtype=np.int32).reshape(3, 4))
    with _raises("head.bias", "dtype_mismatch") as exc:
        decode("head.bias", enc.dtype, enc.shape, enc.data, expected_dtype="float32")
    assert "int32" in exc.value.reason and exc.value.kind == "dtype_mismatch"
    half = encode(np.ones(3, dtype=np.float16))
    with _raises("n", "dtype_mismatch"):  # fp16 is accepted only in place of a wider float
        decode("n", half.dtype, half.shape, half.data, expected_dtype="int64")
    with _raises("n", "dtype_mismatch"):  # and a wider float never stands in for float16
        decode("n", GOOD.dtype, GOOD.shape, GOOD.data, expected_dtype="float16")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_decode_rejects_nonfinite(bad: float, dtype: str) -> None:
    a = np.zeros((2, 2), dtype=dtype)
    a[1, 0] = bad
    enc = encode(a)
    with _raises("conv1.atoms", "nonfinite") as exc:
        decode("conv1.atoms", enc.dtype, enc.shape, enc.data)
    assert str(exc.value) == "tensor 'conv1.atoms': contains NaN or Inf values"
    out = decode("conv1.atoms", enc.dtype, enc.shape, enc.data, allow_nonfinite=True)
    np.testing.assert_array_equal(out, a)


def test_decode_unknown_dtype() -> None:
    with _raises("x", "unknown_dtype") as exc:
        decode("x", "bfloat16", (3, 4), GOOD.data)
    assert "bfloat16" in exc.value.reason and exc.value.kind == "unknown_dtype"


def test_decode_negative_shape() -> None:
    with _raises("x", "bad_shape"):
        decode("x", "float32", (-1, 4), b"")


def test_decode_invalid_bool_bytes() -> None:
    with _raises("mask", "invalid_bool") as exc:
        decode("mask", "bool", (2,), b"\x01\x02")
    assert exc.value.kind == "invalid_bool"


def test_codec_error_is_value_error_with_attributes() -> None:
    err = CodecError("conv1.atoms", "contains NaN or Inf values")
    assert isinstance(err, ValueError)
    assert (err.tensor, err.reason) == ("conv1.atoms", "contains NaN or Inf values")
    assert str(err) == "tensor 'conv1.atoms': contains NaN or Inf values"


# ----------------------------------------------------------------------------- chunking


@pytest.mark.parametrize(
    ("nbytes", "pieces"), [(MiB, 1), (MiB + 1, 2), (MiB * 7 // 2, 4), (1, 1), (MiB - 1, 1), (2 * MiB, 2)]
)
def test_chunk_boundaries(nbytes: int, pieces: int) -> None:
    a = np.arange(nbytes, dtype=np.int64).astype(np.uint8)
    enc = encode(a)
    chunks = list(iter_chunks("big", enc, version=7))
    assert len(chunks) == pieces == math.ceil(nbytes / CHUNK_BYTES)
    assert [c.offset for c in chunks] == [i * CHUNK_BYTES for i in range(pieces)]
    assert all(0 < len(c.data) <= CHUNK_BYTES for c in chunks)
    assert all(
        (c.name, c.dtype, c.shape, c.version, c.total_bytes) == ("big", "uint8", (nbytes,), 7, nbytes) for c in chunks
    )
    assert b"".join(c.data for c in chunks) == enc.data
    np.testing.assert_array_equal(_reassemble(chunks).finish()["big"], a)


def test_small_chunk_size_many_chunks() -> None:
    a = _sample("float32", (5, 7))  # 140 bytes
    chunks = list(iter_chunks("w", encode(a), chunk_bytes=7))
    assert len(chunks) == 20 and all(len(c.data) == 7 for c in chunks)
    np.testing.assert_array_equal(_reassemble(chunks).finish()["w"], a)
    with pytest.raises(ValueError):
        list(iter_chunks("w", encode(a), chunk_bytes=0))


def test_zero_size_tensor_is_one_empty_chunk() -> None:
    for shape in [(0,), (4, 0)]:
        chunks = list(iter_chunks("empty", encode(np.zeros(shape, np.float32))))
        assert len(chunks) == 1 and chunks[0].data == b"" and chunks[0].offset == 0 and chunks[0].total_bytes == 0
        assert _reassemble(chunks).finish()["empty"].shape == shape


def test_reassemble_several_tensors() -> None:
    tensors = {
        "conv1.atoms": _sample("float32", (9, 3, 3)),
        "conv1.coefficients": _sample("float32", (16, 3, 9), seed=1),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(2.5, dtype=np.float64),
        "steps": np.array([1, 2, 3], dtype=np.int64),
        "mask": _sample("bool", (5,)),
    }
    r = _reassemble(_stream(tensors, chunk_bytes=50))
    expected = {n: (a.shape, str(a.dtype)) for n, a in tensors.items()}
    out = r.finish(expected)
    assert list(out) == list(tensors) == list(r.names)
    for n, a in tensors.items():
        assert out[n].dtype == a.dtype
        np.testing.assert_array_equal(out[n], a)
    assert r.bytes_received == sum(a.nbytes for a in tensors.values())
    assert r.versions() == dict.fromkeys(tensors, 3)


def test_reassemble_fp16_upcasts_to_expected() -> None:
    a = _sample("float32", (4, 4))
    chunks = list(iter_chunks("w", encode(a, fp16=True), chunk_bytes=5))
    out = _reassemble(chunks).finish({"w": ((4, 4), "float32")})["w"]
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, a, rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------- a stream resumed inside a tensor


def test_a_stream_cut_inside_a_tensor_resumes_where_it_broke_off() -> None:
    """A link that drops after a few chunks of a tensor: the retry's reassembler goes on from the bytes received,
    whatever comes before that tensor in the retry (a newer version of a tensor completed earlier)."""
    a, b = _sample("float32", (4, 5)), _sample("int64", (6,))
    chunks = _stream({"a": a, "b": b}, chunk_bytes=16)  # a: 80 bytes in 5 chunks, b: 48 in 3
    first = _reassemble(chunks[:7])  # a whole, two chunks of b
    assert first.part == ("b", 3, 32)
    retry = first.resume()
    assert first.finish(complete_only=True).keys() == {"a"}  # what the caller keeps; b's part went with the retry
    newer_a = _sample("float32", (4, 5), seed=9)
    for c in iter_chunks("a", encode(newer_a), 4, 16):  # a changed since: sent again, before b's rest
        retry.add(c)
    retry.add(chunks[7])  # b from byte 32
    out = retry.finish()
    np.testing.assert_array_equal(out["b"], b)
    np.testing.assert_array_equal(out["a"], newer_a)
    assert retry.bytes_received == 80 + 16  # what this stream carried


def test_a_resumed_tensor_sent_whole_again_starts_over_and_one_sent_elsewhere_is_refused() -> None:
    b = _sample("int64", (6,))
    chunks = _stream({"b": b}, chunk_bytes=16)
    newer = _sample("int64", (6,), seed=4)
    restart = Reassembler()
    restart.add(chunks[0])
    retry = restart.resume()
    for c in iter_chunks("b", encode(newer), 5, 16):  # a newer version, from its first byte
        retry.add(c)
    np.testing.assert_array_equal(retry.finish()["b"], newer)
    cut = _reassemble(chunks[:1])
    elsewhere = cut.resume()
    with _raises("b", "offset"):
        elsewhere.add(chunks[2])  # byte 32, where 16 were received
    broke_early = _reassemble(chunks[:1]).resume()
    assert broke_early.part == ("b", 3, 16)  # a retry cut before its first chunk still holds the part
    again = broke_early.resume()
    for c in chunks[1:]:
        again.add(c)
    np.testing.assert_array_equal(again.finish()["b"], b)


# ----------------------------------------------------------------------------- reassembly rejections


def _two() -> list[Chunk]:
    return _stream({"a": _sample("float32", (4, 5)), "b": _sample("int64", (3,))}, chunk_bytes=16)


def test_reassembler_truncated_before_next_tensor() -> None:
    chunks = _two()
    r = Reassembler()
    r.add(chunks[0])
    with _raises("a", "truncated") as exc:
        r.add(next(c for c in chunks if c.name == "b"))
    assert exc.value.kind == "truncated" and "'b'" in exc.value.reason


def test_reassembler_truncated_at_finish() -> None:
    chunks = _two()[:-1]
    r = _reassemble(chunks)
    with _raises("b", "truncated") as exc:
        r.finish()
    assert exc.value.kind == "truncated"


def test_reassembler_oversized_chunk() -> None:
    c = _two()[4]  # last chunk of "a" (80 bytes: 16 × 5)
    r = _reassemble(_two()[:4])
    with _raises("a", "oversized") as exc:
        r.add(Chunk(c.name, c.dtype, c.shape, c.version, c.offset, c.data + b"\0", c.total_bytes))
    assert exc.value.kind == "oversized"
    r.add(c)
    with _raises("a", "oversized"):  # anything after the last byte
        r.add(Chunk(c.name, c.dtype, c.shape, c.version, 80, b"\0", c.total_bytes))


def test_reassembler_total_bytes_must_match_shape() -> None:
    c = _two()[0]
    for total, kind in [(79, "truncated"), (81, "oversized")]:
        with _raises("a", kind) as exc:
            Reassembler().add(Chunk(c.name, c.dtype, c.shape, c.version, 0, c.data, total))
        assert exc.value.kind == kind


@pytest.mark.parametrize("offset", [0, 8, 16, 17, 48])
def test_reassembler_gap_overlap_reorder(offset: int) -> None:
    chunks = _two()
    r = _reassemble(chunks[:2])  # next expected offset is 32
    bad = chunks[1] if offset == 16 else Chunk("a", "float32", (4, 5), 3, offset, b"\0" * 16, 80)
    with _raises("a", "offset") as exc:
        r.add(bad)
    assert exc.value.kind == "offset" and "expected offset 32" in exc.value.reason


def test_reassembler_out_of_order_first_chunk() -> None:
    chunks = _two()
    with _raises("a", "offset") as exc:
        Reassembler().add(chunks[1])
    assert exc.value.kind == "offset"


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "int32"},
        {"shape": (5, 4)},
        {"total_bytes": 96},
        {"version": 4},
    ],
)
def test_reassembler_header_change_mid_stream(change: dict[str, object]) -> None:
    chunks = _two()
    r = _reassemble(chunks[:1])
    fields = {**chunks[1].__dict__, **change}
    with _raises("a", "header_changed") as exc:
        r.add(Chunk(**fields))  # type: ignore[arg-type]
    assert exc.value.kind == "header_changed"


def test_reassembler_duplicate_tensor() -> None:
    a = _stream({"a": _sample("float32", (2,))})
    r = _reassemble(a + _stream({"b": _sample("int32", (2,))}))
    with _raises("a", "duplicate") as exc:
        r.add(a[0])
    assert exc.value.kind == "duplicate"


def test_reassembler_duplicate_empty_chunk() -> None:
    r = _reassemble(_stream({"e": np.zeros(0, np.float32)}))
    with _raises("e", "duplicate"):
        r.add(_stream({"e": np.zeros(0, np.float32)})[0])


def test_reassembler_rejects_empty_chunk_of_nonempty_tensor() -> None:
    with _raises("a", "empty_chunk"):
        Reassembler().add(Chunk("a", "float32", (2,), 0, 0, b"", 8))


def test_reassembler_unknown_dtype() -> None:
    with _raises("a", "unknown_dtype") as exc:
        Reassembler().add(Chunk("a", "complex64", (2,), 0, 0, b"\0" * 16, 16))
    assert exc.value.kind == "unknown_dtype"


def test_reassembler_max_total_bytes() -> None:
    chunks = _two()  # 80 + 24 bytes
    assert _reassemble(chunks, max_total_bytes=104).finish()
    r = Reassembler(max_total_bytes=103)
    for c in chunks[:5]:
        r.add(c)
    with _raises("b", "too_large") as exc:
        r.add(chunks[5])  # refused on the declared size, before its bytes are buffered
    assert exc.value.kind == "too_large"
    assert r.bytes_received == 80


def test_finish_unknown_tensor() -> None:
    r = _reassemble(_two())
    with _raises("b", "unknown_tensor") as exc:
        r.finish({"a": ((4, 5), "float32")})
    assert exc.value.reason == "unknown tensor" and exc.value.kind == "unknown_tensor"


def test_finish_checks_expected_shape_dtype_and_finiteness() -> None:
    with _raises("a", "shape_mismatch"):
        _reassemble(_two()).finish({"a": ((5, 4), "float32"), "b": ((3,), "int64")})
    with _raises("b", "dtype_mismatch"):
        _reassemble(_two()).finish({"a": ((4, 5), "float32"), "b": ((3,), "int32")})
    bad = np.ones(3, np.float32)
    bad[2] = np.nan
    with _raises("n", "nonfinite"):
        _reassemble(_stream({"n": bad})).finish()
    assert np.isnan(_reassemble(_stream({"n": bad})).finish(allow_nonfinite=True)["n"][2])


def test_finish_allows_missing_expected_names() -> None:
    out = _reassemble(_stream({"a": np.ones(2, np.float32)})).finish({"a": ((2,), "float32"), "z": ((1,), "int64")})
    assert list(out) == ["a"]


# ----------------------------------------------------------------------------- property test

_shapes = st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    items=st.lists(st.tuples(st.sampled_from(list(DTYPES)), _shapes, st.booleans()), min_size=1, max_size=4),
    chunk_bytes=st.integers(1, 64),
    seed=st.integers(0, 2**16),
)
def test_property_round_trip_through_chunks(
    items: list[tuple[str, tuple[int, ...], bool]], chunk_bytes: int, seed: int
) -> None:
    tensors = {f"t{i}": _sample(dtype, shape, seed + i) for i, (dtype, shape, _) in enumerate(items)}
    r = Reassembler()
    expected = {}
    for i, (name, arr) in enumerate(tensors.items()):
        fp16 = items[i][2]
        enc = encode(arr, fp16=fp16)
        assert enc.nbytes == encoded_size(arr.shape, str(arr.dtype), fp16=fp16)
        chunks = list(iter_chunks(name, enc, chunk_bytes=chunk_bytes))
        assert len(chunks) == max(1, math.ceil(enc.nbytes / chunk_bytes))
        assert all(len(c.data) <= chunk_bytes for c in chunks)
        for c in chunks:
            r.add(c)
        expected[name] = (arr.shape, str(arr.dtype))
    out = r.finish(expected)
    for name, arr in tensors.items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        if arr.dtype.kind == "f" and items[int(name[1:])][2]:
            np.testing.assert_allclose(out[name], arr, rtol=1e-3, atol=1e-3)
        else:
            np.testing.assert_array_equal(out[name], arr)


def test_reassembler_first_finish_hands_over_its_buffers() -> None:
    """The first finish() returns writable arrays over the receive buffers (no copy); a second one copies."""
    a = np.arange(600_000, dtype=np.float32).reshape(600, 1000)
    r = _reassemble(list(iter_chunks("w", encode(a), chunk_bytes=1 << 20)))
    first = r.finish()["w"]
    np.testing.assert_array_equal(first, a)
    assert first.flags.writeable and first.dtype == np.float32
    first[0, 0] = -1.0  # the caller owns it now
    second = r.finish()["w"]
    assert not np.shares_memory(first, second) and second.flags.writeable and second[0, 0] == -1.0


def test_decode_without_copy_still_copies_read_only_or_converted_data() -> None:
    """``copy=False`` may share a writable buffer only; bytes (read-only) and an fp16 upcast are fresh arrays."""
    a = np.linspace(-1, 1, 12, dtype=np.float32)
    data = encode(a).data
    from_bytes = decode("x", "float32", (12,), data, copy=False)
    assert from_bytes.flags.writeable
    buf = bytearray(data)
    shared = decode("x", "float32", (12,), buf, copy=False)
    assert np.shares_memory(shared, np.frombuffer(buf, dtype=np.float32))
    half = encode(a, fp16=True)
    up = decode("x", "float16", (12,), bytearray(half.data), expected_dtype="float32", copy=False)
    assert up.dtype == np.float32 and up.flags.writeable


def test_a_chunk_over_one_mib_is_too_large_before_it_is_buffered() -> None:
    a = np.zeros(CHUNK_BYTES // 4 + 1, np.float32)
    (chunk,) = iter_chunks("w", encode(a), chunk_bytes=CHUNK_BYTES + 4)
    r = Reassembler()
    with pytest.raises(CodecError, match="chunk of 1048580 bytes exceeds the 1048576-byte chunk limit") as err:
        r.add(chunk)
    assert err.value.kind == "too_large" and r.bytes_received == 0
    for c in iter_chunks("w", encode(a)):  # the same tensor in 1 MiB chunks is fine
        r.add(c)
    np.testing.assert_array_equal(r.finish()["w"], a)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_all_finite_is_exact_even_when_a_sum_overflows(dtype: str) -> None:
    big = float(np.finfo(dtype).max)
    assert all_finite(np.array([big, big], dtype))  # the sum overflows; the values are finite
    assert all_finite(np.zeros(0, dtype)) and all_finite(np.arange(5))
    for bad in (np.nan, np.inf, -np.inf):
        a = np.ones(1000, dtype)
        a[517] = bad
        assert not all_finite(a)
    mixed = np.array([np.inf, -np.inf], dtype)  # sums to NaN
    assert not all_finite(mixed)


# ----------------------------------------------------------------------------- spooled reassembly


@pytest.mark.parametrize("chunk_bytes", [7, 4096, CHUNK_BYTES])
def test_a_spooled_stream_reassembles_every_dtype_and_rank_as_in_memory(tmp_path, chunk_bytes: int) -> None:
    """The same stream into memory and through a spool file gives equal arrays, 0-d and empty included."""
    tensors = {
        f"{dtype}{len(shape)}": _sample(dtype, shape, i)
        for i, (dtype, shape) in enumerate(
            [
                ("float32", (33, 5)),
                ("float16", (4,)),
                ("int64", ()),
                ("bool", (3, 3)),
                ("float32", (0, 2)),
                ("uint8", (9,)),
            ]
        )
    }
    chunks = _stream(tensors, chunk_bytes)
    with (tmp_path / "spool").open("w+b") as f:
        spooled = _reassemble(chunks, spool=f).finish()
    in_memory = _reassemble(chunks).finish()
    assert list(spooled) == list(tensors)
    for name, array in tensors.items():
        np.testing.assert_array_equal(spooled[name], array)
        np.testing.assert_array_equal(in_memory[name], array)
        assert spooled[name].shape == array.shape and spooled[name].dtype == array.dtype


def test_receiving_into_a_spool_holds_a_chunk_not_the_message(tmp_path) -> None:
    """32 MiB arrive in 1 MiB chunks: the spooled receiver's Python and numpy allocations (tracemalloc) stay
    under 2 MiB until finish() reads the tensor back; the in-memory receiver's reach the message's size."""
    import tracemalloc

    total = 32 * MiB
    chunks = list(iter_chunks("w", encode(np.arange(total // 4, dtype=np.float32)), 0))

    def peak_while_receiving(**kw: object) -> int:
        tracemalloc.start()
        try:
            r = _reassemble(chunks, **kw)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        np.testing.assert_array_equal(r.finish()["w"], np.arange(total // 4, dtype=np.float32))
        return peak

    with (tmp_path / "spool").open("w+b") as f:
        assert peak_while_receiving(spool=f) < 2 * MiB
        assert f.seek(0, 2) == total  # the bytes went to the file
    assert peak_while_receiving() >= total


def test_a_spooled_stream_refuses_what_an_in_memory_one_does(tmp_path) -> None:
    """Gaps and truncation are refused by chunk bookkeeping, whichever the buffer."""
    chunks = _stream({"a": np.ones(100, np.float32)}, 64)
    with (tmp_path / "spool").open("w+b") as f:
        r = Reassembler(spool=f)
        r.add(chunks[0])
        with _raises("a", "offset"):
            r.add(chunks[2])
        with _raises("a", "truncated"):
            r.finish()


# --------------------------------------------------------------------------- resuming a stream


def test_progress_names_where_a_broken_stream_resumes() -> None:
    """Hand cases: nothing, part of the first tensor, a tensor just completed, a zero-size one, part of the next."""
    a = codec.encode(np.arange(10, dtype=np.float32), name="a")  # 40 bytes
    empty = codec.encode(np.zeros((0, 3), dtype=np.float32), name="empty")
    b = codec.encode(np.arange(6, dtype=np.int64), name="b")  # 48 bytes
    r = codec.Reassembler()
    assert r.progress == (0, 0)
    chunks_a = list(codec.iter_chunks("a", a, chunk_bytes=16))  # 16 + 16 + 8
    r.add(chunks_a[0])
    assert r.progress == (0, 16)
    r.add(chunks_a[1])
    r.add(chunks_a[2])
    assert r.progress == (1, 0)
    r.add(next(codec.iter_chunks("empty", empty)))
    assert r.progress == (2, 0)
    r.add(next(codec.iter_chunks("b", b, chunk_bytes=40)))
    assert r.progress == (2, 40)
    # the rest, sent from the offset progress names, completes the same arrays
    for chunk in codec.iter_chunks("b", b, start=40):
        r.add(chunk)
    assert r.progress == (3, 0)
    out = r.finish()
    np.testing.assert_array_equal(out["a"], np.arange(10, dtype=np.float32))
    assert out["empty"].shape == (0, 3)
    np.testing.assert_array_equal(out["b"], np.arange(6, dtype=np.int64))


def test_iter_chunks_from_an_offset() -> None:
    enc = codec.encode(np.arange(5, dtype=np.float32), name="x")  # 20 bytes
    assert [(c.offset, len(c.data)) for c in codec.iter_chunks("x", enc, chunk_bytes=8, start=12)] == [(12, 8)]
    assert [(c.offset, len(c.data)) for c in codec.iter_chunks("x", enc, chunk_bytes=8, start=4)] == [(4, 8), (12, 8)]
    for bad in (-1, 20, 25):
        with pytest.raises(ValueError, match=r"start must be in \[0, 20\)"):
            list(codec.iter_chunks("x", enc, start=bad))


def test_a_codec_error_crosses_a_process_boundary_whole() -> None:
    """An error a worker process raises (the benchmark's --jobs, a Ray actor) reaches the parent pickled:
    with ValueError's default pickling it could not be rebuilt, and the parent saw only a TypeError."""
    with ProcessPoolExecutor(max_workers=1) as pool:
        future = pool.submit(_raise_codec_error, "conv1.weight")
        with pytest.raises(CodecError) as caught:
            future.result(timeout=60)
    assert (caught.value.tensor, caught.value.kind) == ("conv1.weight", "fp16_overflow")
    assert str(caught.value) == "tensor 'conv1.weight': 70000 overflows float16"
    again = pickle.loads(pickle.dumps(caught.value))
    assert (type(again), again.args, again.reason) == (CodecError, caught.value.args, "70000 overflows float16")


def _raise_codec_error(name: str) -> None:
    raise CodecError(name, "70000 overflows float16", "fp16_overflow")
