"""GGUF block decoding is bit-exact: dgpp's torch decoders against a decoder written here from the block
format (numpy structured records, one formula per type), on random blocks covering every nibble/int8
value and fp16 scales of every magnitude (subnormals included), and through real GGUF files the ``gguf``
package writes (its own quantizer, its own dequantizer as a third opinion)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dgpp.checkpoint.gguf_blocks import decode_tensor
from dgpp.errors import CheckpointError

gguf = pytest.importorskip("gguf")

# the block records as ggml.h declares them
RECORDS = {
    "Q8_0": np.dtype([("d", "<f2"), ("qs", "i1", 32)]),
    "Q4_0": np.dtype([("d", "<f2"), ("qs", "u1", 16)]),
    "Q4_1": np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
}


def reference_decode(raw: bytes, kind: str) -> np.ndarray:
    """Weights of the blocks in ``raw``, per the spec, in float32 arithmetic (what ggml computes)."""
    blocks = np.frombuffer(raw, dtype=RECORDS[kind])
    d = blocks["d"].astype(np.float32)[:, None]
    if kind == "Q8_0":
        return (d * blocks["qs"].astype(np.float32)).reshape(-1)
    qs = blocks["qs"]
    values = np.empty((len(blocks), 32), dtype=np.float32)
    for j in range(16):  # byte j: weight j in the low nibble, weight j + 16 in the high nibble
        values[:, j] = qs[:, j] & 0x0F
        values[:, j + 16] = qs[:, j] >> 4
    if kind == "Q4_0":
        return (d * (values - np.float32(8))).reshape(-1)
    m = blocks["m"].astype(np.float32)[:, None]
    return (d * values + m).reshape(-1)


def random_blocks(kind: str, count: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    blocks = np.zeros(count, dtype=RECORDS[kind])
    # scales: random fp16 bit patterns that are finite (normal and subnormal, both signs)
    bits = rng.integers(0, 0x7C00, size=count, dtype=np.uint16) | (
        rng.integers(0, 2, size=count, dtype=np.uint16) << 15
    )
    blocks["d"] = bits.view(np.float16)
    if kind == "Q4_1":
        blocks["m"] = (rng.integers(0, 0x7C00, size=count, dtype=np.uint16)).view(np.float16)
    width = 32 if kind == "Q8_0" else 16
    blocks["qs"] = rng.integers(0, 256, size=(count, width), dtype=np.uint8).view(blocks["qs"].dtype)
    return blocks.tobytes()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_decoders_are_bit_exact(kind):
    raw = random_blocks(kind, count=4096, seed=len(kind) + ord(kind[1]))
    ours = decode_tensor(np.frombuffer(raw, dtype=np.uint8), kind, (128, 1024), "t").numpy().reshape(-1)
    want = reference_decode(raw, kind)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16"])
def test_float_types_keep_their_bits(kind):
    values = torch.randn(6, 64)
    dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
    stored = values.to(dtype)
    raw = stored.view(torch.uint8).numpy() if kind == "BF16" else stored.numpy()
    got = decode_tensor(raw, kind, (6, 64), "t")
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), stored.view(torch.uint8))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "F16", "F32"])
def test_tensors_written_by_the_gguf_package_decode_exactly(tmp_path, kind):
    from dgpp.checkpoint.gguf_file import GGUFFile

    rng = np.random.default_rng(3)
    data = (rng.standard_normal((48, 96)) * 0.7).astype(np.float32)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor("w", data)
    elif kind == "F16":
        writer.add_tensor("w", data.astype(np.float16))
    else:
        writer.add_tensor("w", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    assert file.shape("w") == (48, 96) and file.type_name("w") == kind
    ours = file.tensor("w").float().numpy()
    raw = np.asarray(gguf.GGUFReader(str(path)).tensors[0].data)
    if kind in RECORDS:
        np.testing.assert_array_equal(
            ours.reshape(-1).view(np.uint32), reference_decode(raw.tobytes(), kind).view(np.uint32)
        )
    theirs = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(48, 96)
    np.testing.assert_array_equal(ours, theirs)


def test_unsupported_types_and_sizes_are_named():
    with pytest.raises(
        CheckpointError, match=r"tensor 'blk.0.ffn_up.weight'.*Q4_K is not supported.*K-quants"
    ):
        decode_tensor(np.zeros(144, np.uint8), "Q4_K", (256,), "tensor 'blk.0.ffn_up.weight'")
    with pytest.raises(CheckpointError, match=r"Q8_0 data holds 33 bytes, expected 34"):
        decode_tensor(np.zeros(33, np.uint8), "Q8_0", (32,), "t")
    with pytest.raises(CheckpointError, match="not whole 32-weight blocks"):
        decode_tensor(np.zeros(34 * 2, np.uint8), "Q8_0", (4, 16), "t")
