"""DeepSeek-V4.1-Flash's decode attention over its packed caches in the fused kernels (Triton interpreter, fp32):
the block-scaled tile loaders give exactly the values ``v41_packed_entries``' ``decode`` gives (a dropped scale or
swapped nibbles fail), the packed compressed-decode kernel matches the torch form over the decoded ring and pool
(partly filled rings, padding rows, selections shorter than the pick table, window-only rows) and keeps a row's
bits alone or batched, the packed ring write stores exactly the bytes ``PackedFP8.encode`` gives, the indexer's
scores read the packed FP4 + E8M0 keys in-kernel, and the tiny fixture decodes the same greedy tokens through the
fused path as through the torch path."""

from __future__ import annotations

import pytest
import torch
from test_deepseek_v41 import build_fp32_fixture

from dgpp.kernels._triton import HAS_TRITON, tl, triton
from dgpp.kernels.block_scaled_ring_write import ring_write_fp8_blocks_triton
from dgpp.kernels.block_scaled_tiles import PackedKeyForms, packed_fp4_tile, packed_fp8_tile
from dgpp.kernels.compressed_decode_attention import (
    CompressedDecodeInputs,
    compressed_decode_attention_ref,
    compressed_decode_attention_triton,
)
from dgpp.kernels.dsa_index import index_scores_ref, index_scores_triton
from dgpp.offline import engine_all_logits, greedy_generate, make_prompts
from dgpp.plugin_api import load_model
from dgpp_deepseek import v41_attention, v41_indexer
from dgpp_deepseek.v41_latent_formats import round_fp8_e8m0
from dgpp_deepseek.v41_packed_entries import PackedFP4, PackedFP8

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the interpreter runs on the CPU)")

DIM, HEADS, CAP, BS, RATIO = 64, 4, 7, 8, 2
FORMS = PackedKeyForms()  # the release's: ring FP8 + E8M0 per 32, entries FP4 + E4M3 per 16


def _values(rows: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Values over many binades per row (so every block has its own scale), with zeros and E2M1 ties."""
    binades = torch.randint(-8, 6, (rows, dim // 16), generator=gen).float().repeat_interleave(16, 1)
    x = torch.randn(rows, dim, generator=gen) * torch.exp2(binades)
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[1, 16:32] = 0.0
    return x


@triton.jit
def _tile_kernel(
    u8_ptr,
    f8_ptr,
    out_ptr,
    dim,
    width,
    FP4: tl.constexpr,
    BLOCK: tl.constexpr,
    E8M0: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    mask = (rows[:, None] < ROWS) & (cols[None, :] < dim)
    at = rows.to(tl.int64) * width
    if FP4:
        tile = packed_fp4_tile(u8_ptr, f8_ptr, at, cols, mask, dim, tl.float32, BLOCK, E8M0)
    else:
        tile = packed_fp8_tile(u8_ptr, f8_ptr, at, cols, mask, dim, tl.float32, BLOCK)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], tile, mask=mask)


def _load_tile(form, stored: torch.Tensor) -> torch.Tensor:
    out = torch.empty(stored.shape[0], form.dim)
    fp4 = isinstance(form, PackedFP4)
    _tile_kernel[(1,)](
        stored,
        stored.view(torch.float8_e4m3fn),
        out,
        form.dim,
        form.width,
        FP4=fp4,
        BLOCK=form.block,
        E8M0=fp4 and form.scale_kind == "e8m0",
        ROWS=stored.shape[0],
        COLS=form.dim,
    )
    return out


@pytest.mark.parametrize(
    "form",
    [PackedFP4(DIM, 16, "e4m3"), PackedFP4(32, 32, "e8m0"), PackedFP8(DIM)],
    ids=["entry-fp4-e4m3", "index-key-fp4-e8m0", "ring-fp8-e8m0"],
)
def test_tile_loaders_give_the_torch_decode(form):
    stored = form.encode(_values(16, form.dim, torch.Generator().manual_seed(form.dim + form.block)))
    want = form.decode(stored, torch.float32)
    assert torch.equal(_load_tile(form, stored), want)
    # the check is able to fail: these bytes read with swapped nibbles, or without their scales, give other values
    if isinstance(form, PackedFP4):
        half = form.dim // 2
        swapped = torch.cat([(stored[:, :half] >> 4) | (stored[:, :half] << 4), stored[:, half:]], 1)
        assert not torch.equal(form.decode(swapped, torch.float32), want)
    unit = 0x38 if isinstance(form, PackedFP4) and form.scale_kind == "e4m3" else 127  # a scale of 1
    no_scale = stored.clone()
    no_scale[:, form.width - form.dim // form.block :] = unit
    assert not torch.equal(form.decode(no_scale, torch.float32), want)


def _packed_case(positions: list[int], seed: int, counts: list[int]) -> tuple[dict, dict]:
    """(packed inputs, the same with ring and pool decoded): rings of random rows (a row past the slot's filled
    positions is never read), a shuffled block table, picks in any order with ``counts`` of them valid."""
    gen = torch.Generator().manual_seed(seed)
    rows, per_block = len(positions), BS // RATIO
    ring_form, entry_form = PackedFP8(DIM), PackedFP4(DIM, 16, "e4m3")
    ring = ring_form.encode(_values((rows + 2) * CAP, DIM, gen)).view(rows + 2, CAP, 1, -1)
    num_blocks = 32 * rows
    pool = entry_form.encode(_values(num_blocks * per_block, DIM, gen)).view(num_blocks, per_block, 1, -1)
    tables = torch.randperm(num_blocks, generator=gen).view(rows, 32).int()
    pos = torch.tensor(positions)
    width = max(1, *counts)
    picks = torch.zeros(rows, width, dtype=torch.int32)
    for r, (p, n) in enumerate(zip(positions, counts, strict=True)):
        picks[r, :n] = torch.randperm(max(1, (p + 1) // RATIO), generator=gen)[:n].int()
    packed = dict(
        q=torch.randn(rows, HEADS, DIM, generator=gen),
        kv=round_fp8_e8m0(torch.randn(rows, DIM, generator=gen)),
        ring=ring,
        pool=pool,
        tables=tables,
        slots=torch.arange(rows) + 1,
        positions=pos,
        seq_lens=(pos + 1).int(),
        sinks=torch.randn(HEADS, generator=gen),
        scale=DIM**-0.5,
        ratio=RATIO,
        picks=picks,
        counts=torch.tensor(counts, dtype=torch.int32),
    )
    decoded = {
        **packed,
        "ring": ring_form.decode(ring, torch.float32),
        "pool": entry_form.decode(pool, torch.float32),
    }
    return packed, decoded


def _attend(args: dict) -> torch.Tensor:
    return compressed_decode_attention_triton(CompressedDecodeInputs(**args), 8, 32, packed=FORMS)


def test_packed_kernel_matches_the_torch_decode_and_reference_attention():
    # a first row, partly filled rings, a padding slot, a zero-length row, a window-only row (count 0), selections
    # shorter than the table, and rows long enough for several splits
    positions = [0, 3, 40, 90, 200, 17, 63]
    counts = [0, 2, 20, 11, 30, 0, 7]
    packed, decoded = _packed_case(positions, seed=1, counts=counts)
    packed["slots"][2] = decoded["slots"][2] = -1
    packed["seq_lens"][3] = decoded["seq_lens"][3] = 0
    out = _attend(packed)
    torch.testing.assert_close(
        out, compressed_decode_attention_ref(CompressedDecodeInputs(**decoded)), rtol=1e-5, atol=1e-5
    )
    assert float(out[2].abs().max()) == 0.0 and float(out[3].abs().max()) == 0.0
    # the packed bytes are what is read: the same kernel over the decoded ring and pool agrees to the bit
    assert torch.equal(compressed_decode_attention_triton(CompressedDecodeInputs(**decoded), 8, 32), out)
    # a row alone has the bits it has batched
    for r in (1, 4, 6):
        alone = {
            k: v[r : r + 1]
            if k in ("q", "kv", "tables", "slots", "positions", "seq_lens", "picks", "counts")
            else v
            for k, v in packed.items()
        }
        assert torch.equal(_attend(alone)[0], out[r])


def test_counts_bound_what_a_row_reads():
    packed, decoded = _packed_case([60, 60], seed=2, counts=[9, 9])
    out = _attend(packed)
    fewer = {**packed, "counts": torch.tensor([9, 4], dtype=torch.int32)}
    moved = _attend(fewer)
    assert torch.equal(moved[0], out[0]) and not torch.equal(moved[1], out[1])
    torch.testing.assert_close(
        moved,
        compressed_decode_attention_ref(CompressedDecodeInputs(**{**decoded, "counts": fewer["counts"]})),
        rtol=1e-5,
        atol=1e-5,
    )


def test_packed_inputs_must_have_the_forms_widths():
    packed, _ = _packed_case([5], seed=3, counts=[1])
    with pytest.raises(ValueError, match="uint8 rows"):
        _attend({**packed, "ring": packed["ring"][..., :-1]})


@pytest.mark.parametrize("pre_rounded", [True, False], ids=["layer-rows", "any-values"])
def test_ring_write_stores_the_packed_rows(pre_rounded):
    gen = torch.Generator().manual_seed(4)
    form = PackedFP8(DIM)
    kv = _values(5, DIM, gen)
    kv[2, :32] = 0.0
    kv[3, 5] = 1e-12  # rounds to zero in its block
    kv[3, 6] = -1e-12
    if pre_rounded:
        kv = round_fp8_e8m0(kv)
    ring = torch.randint(0, 256, (7, CAP, 1, form.width), dtype=torch.uint8, generator=gen)
    before = ring.clone()
    slots = torch.tensor([1, 3, -1, 4, 6])
    positions = torch.tensor([7, 0, 3, 12, 29])
    seq_lens = torch.tensor([8, 1, 4, 13, 0])
    ring_write_fp8_blocks_triton(kv, ring, slots, positions, seq_lens)
    want = before.clone()
    for r in (0, 1, 3):  # row 2 has no slot, row 4 no length: they write nothing
        want[slots[r], positions[r] % CAP, 0] = form.encode(kv[r : r + 1])[0]
    assert torch.equal(ring, want)


def test_index_scores_read_the_packed_keys():
    """The indexer's scores over FP4 + E8M0 keys read in-kernel against the torch scores over the decoded keys;
    rows past their visible entries are -inf, a padding row (0 visible) all -inf."""
    gen = torch.Generator().manual_seed(5)
    form, rows, heads, dim, per_block = PackedFP4(32, 32, "e8m0"), 4, 6, 32, 4
    keys = form.encode(_values(48 * per_block, dim, gen)).view(48, per_block, 1, -1)
    tables = torch.randperm(48, generator=gen).view(rows, 12).int()
    seen = torch.tensor([0, 5, 33, 48])
    q = torch.randn(rows, heads, dim, generator=gen)
    weights = torch.randn(rows, heads, generator=gen)
    forms = PackedKeyForms(entry_block=32, entry_e8m0=True)
    got = index_scores_triton(q, weights, keys, tables, seen, 1.0, packed=forms)
    want = index_scores_ref(q, weights, form.decode(keys, torch.float32), tables, seen, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool(torch.isinf(got[0]).all()) and bool(torch.isinf(got[1, 5:]).all())
    with pytest.raises(ValueError, match="uint8 rows"):
        index_scores_triton(q, weights, keys[..., :-1], tables, seen, 1.0, packed=forms)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_fp32_fixture(tmp_path_factory.mktemp("deepseek_v41_fused"))


def _fused(model, on: bool | None) -> None:
    for module in model.modules():
        if isinstance(module, v41_attention.DeepseekV41Attention):
            module.fused_decode = on


def test_fixture_decodes_through_the_fused_kernels(checkpoint, monkeypatch):
    """Every layer kind (window-only, ratio 2 and ratio 1 with candidates) decodes through the packed kernels:
    greedy tokens equal to the torch path's, one-token-step logits within fp32 summation order of them."""
    model = load_model(checkpoint)
    calls, scored = [], []
    real, real_scores = v41_attention.packed_decode_attention, v41_indexer.index_scores_triton

    def counted(layer, *args):
        calls.append(layer.ratio)
        return real(layer, *args)

    def counted_scores(*args, **kwargs):
        scored.append(kwargs["packed"])
        return real_scores(*args, **kwargs)

    monkeypatch.setattr(v41_attention, "packed_decode_attention", counted)
    monkeypatch.setattr(v41_indexer, "index_scores_triton", counted_scores)
    prompts = make_prompts(model.info.vocab_size, (7, 19), seed=8)
    torch_tokens = greedy_generate(model, prompts, 10, stop_at_eos=False)
    torch_logits = engine_all_logits(model, prompts, chunk_size=1)
    assert not calls and not scored
    _fused(model, True)
    try:
        fused_tokens = greedy_generate(model, prompts, 10, stop_at_eos=False)
        fused_logits = engine_all_logits(model, prompts, chunk_size=1)
    finally:
        _fused(model, None)
    assert set(calls) == {0, 1, 2} and scored  # every layer kind, and the indexers
    assert fused_tokens == torch_tokens
    for a, b in zip(fused_logits, torch_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
