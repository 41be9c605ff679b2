"""DeepSeek-V4.1-Flash's caches held packed (``dgpp_deepseek.v41_packed_entries``): main entries as FP4 E2M1 nibbles
with an E4M3 scale per 16, index keys as FP4 with an E8M0 scale per 32, window rings as FP8 E4M3 with an E8M0
scale per 32. The pools and rings are bytes of the packed size; every stored row decodes, by the bit-level
decoders of ``deepseek_v41_formats``, to the trained rounding of its value; and the logits are bit for bit those
of caches that hold the rounded values in the compute dtype (one-shot, chunked, one token per step), while
holding the unrounded values moves them."""

from __future__ import annotations

import pytest
import torch
from deepseek_v41_entry_forms import hold_values
from deepseek_v41_formats import decode_e2m1, decode_e4m3, decode_e8m0, unpack_e2m1_pairs
from test_deepseek_v41 import build_fp32_fixture

from dgpp.offline import engine_all_logits, greedy_generate, make_pools, make_prompts
from dgpp.startup.loading import load_model
from dgpp_deepseek.v41_latent_formats import round_fp4_e4m3, round_fp4_e8m0, round_fp8_e8m0
from dgpp_deepseek.v41_packed_entries import EntryFormats, PackedFP4, PackedFP8

HEAD_DIM, INDEX_DIM = 64, 32  # the fixture's latent and index-key widths
LENGTHS = (5, 23, 40, 9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_fp32_fixture(tmp_path_factory.mktemp("deepseek_v41_packed"))


def _values(rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Values spread over many binades, with exact zeros, E2M1 ties and a block of zeros among them."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, dim, generator=gen) * torch.exp2(
        torch.randint(-12, 8, (rows, 1), generator=gen).float()
    )
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * torch.tensor([1.0, -1.0] * 8)
    x[1, :32] = 0.0
    x[2, 5] = -0.0
    return x.to(dtype)


def _decode_independently(rows: torch.Tensor, dim: int, block: int, scale_bytes) -> torch.Tensor:
    """Packed rows decoded from their bit fields (float64): E2M1 nibbles times the block's scale byte."""
    nibbles = unpack_e2m1_pairs(rows[:, : dim // 2])
    scales = scale_bytes(rows[:, dim // 2 :]).repeat_interleave(block, dim=1)
    return decode_e2m1(nibbles) * scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "form,rounding,scale_bytes",
    [
        (PackedFP4(HEAD_DIM, 16, "e4m3"), round_fp4_e4m3, decode_e4m3),
        (PackedFP4(INDEX_DIM, 32, "e8m0"), round_fp4_e8m0, decode_e8m0),
    ],
)
def test_packed_rows_hold_the_trained_rounding(form, rounding, scale_bytes, dtype):
    x = _values(40, form.dim, dtype)
    rows = form.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (40, form.dim // 2 + form.dim // form.block)
    rounded = rounding(x)
    decoded = form.decode(rows, dtype)
    assert torch.equal(
        decoded.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        rounded.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )  # -0.0 too
    assert torch.equal(_decode_independently(rows, form.dim, form.block, scale_bytes), rounded.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_fp8_rows_hold_the_window_form(dtype):
    """The DSpark context rows' form: E4M3 codes and an E8M0 scale per 32, the values ``round_fp8_e8m0`` gives."""
    form = PackedFP8(HEAD_DIM)
    x = _values(40, HEAD_DIM, dtype)
    rows = form.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (40, HEAD_DIM + HEAD_DIM // 32)
    rounded = round_fp8_e8m0(x)
    assert torch.equal(form.decode(rows, dtype), rounded)
    scales = decode_e8m0(rows[:, HEAD_DIM:]).repeat_interleave(32, dim=1)
    assert torch.equal(decode_e4m3(rows[:, :HEAD_DIM]) * scales, rounded.double())
    assert torch.equal(
        form.decode(form.encode(rounded), dtype), rounded
    )  # a ring packed again keeps its values


def test_the_pools_are_the_packed_size(checkpoint):
    """36 bytes per 64-wide entry (32 nibble pairs + 4 E4M3 scales), 17 per 32-wide index key (16 + 1 E8M0)."""
    model = load_model(checkpoint)
    spec = model.cache_spec()
    pools, _, _ = make_pools(model, [32], 16)
    for source in (2, 4, 6):
        for part, width in (("compressor", 36), ("indexer", 17)):
            name = f"layers.{source}.attn.{part}"
            assert (spec[name].head_dim, spec[name].dtype) == (width, torch.uint8)
            assert pools.kv[name][0].dtype == torch.uint8 and pools.kv[name][0].shape[-1] == width
    for layer in range(10):  # every window ring: 64 E4M3 codes and 2 E8M0 scales a row
        ring = spec[f"layers.{layer}.attn"]
        assert (ring.head_dim, ring.dtype) == (66, torch.uint8)
        assert pools.state[f"layers.{layer}.attn"]["k"].dtype == torch.uint8
    # per token: the two ratio-2 groups' entries and keys every second token (a 17-byte key counts as 9), the
    # ratio-1 group's every token
    packed = 2 * (36 // 2 + 9) + (36 + 17)
    compressed = sum(s.bytes_per_token() for n, s in spec.items() if n.endswith(("compressor", "indexer")))
    assert compressed == packed


def test_release_widths_give_890_bytes_per_token():
    release = EntryFormats.release(512, 128)
    assert (release.main.width, release.index.width) == (288, 68)
    assert 3 * (288 + 68) // 2 + (288 + 68) == 890


@pytest.fixture(scope="module")
def packed_and_rounded(checkpoint):
    packed, rounded = load_model(checkpoint), load_model(checkpoint)
    hold_values(rounded, rounded=True)
    return packed, rounded


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_packed_cache_gives_the_rounded_cache_logits_bit_for_bit(packed_and_rounded, chunk):
    packed, rounded = packed_and_rounded
    prompts = make_prompts(packed.info.vocab_size, LENGTHS, seed=5)
    for a, b in zip(
        engine_all_logits(packed, prompts, chunk_size=chunk),
        engine_all_logits(rounded, prompts, chunk_size=chunk),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_packed_cache_greedy_equals_the_rounded_cache(packed_and_rounded):
    packed, rounded = packed_and_rounded
    prompts = make_prompts(packed.info.vocab_size, (7, 26), seed=6)
    assert greedy_generate(packed, prompts, 24, stop_at_eos=False) == greedy_generate(
        rounded, prompts, 24, stop_at_eos=False
    )


def test_unrounded_entries_move_the_logits(checkpoint, packed_and_rounded):
    """The comparison above can fail: a cache that holds the entries unrounded gives other logits."""
    packed, _ = packed_and_rounded
    unrounded = load_model(checkpoint)
    hold_values(unrounded, rounded=False)
    prompts = make_prompts(packed.info.vocab_size, (40,), seed=5)
    assert not torch.equal(engine_all_logits(packed, prompts)[0], engine_all_logits(unrounded, prompts)[0])
