"""The window compressor's decode step (Triton interpreter, fp32): the torch form of the pool against the
compressor's own pool of a window, and the fused kernel (pool, norm, rotation, entry store, ring write) against
the torch form composed with the compressor's norm and rotation: overlapping (CSA) and not (HCA), rows that close
a window and rows that do not, the first window (no predecessor), a padding row, angles rounded or kept fp32."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.window_pool import EntryFinish, window_compress_decode_triton, window_pool_decode_ref
from dgpp.nn.rotary import TrailingRotary
from dgpp.nn.window_compressor import WindowCompressor

DIM, HIDDEN, ROT, BS = 24, 16, 8, 8


def _compressor(ratio: int, overlap: bool, fp32_angles: bool, seed: int) -> WindowCompressor:
    rotary = TrailingRotary(ROT, 10000.0, fp32_angles=fp32_angles)
    rotary.magnitude = 1.25  # as YaRN scales the angles' cos/sin
    comp = WindowCompressor(HIDDEN, DIM, ratio, rotary, "c", overlap=overlap, dtype=torch.float32, eps=1e-6)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        comp.ape.copy_(torch.randn(comp.ape.shape, generator=g))
        comp.norm.weight.copy_(1 + 0.3 * torch.randn(DIM, generator=g))
    return comp


def _step(comp: WindowCompressor, positions: list[int], seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    cap, rows = (2 if comp.overlap else 1) * comp.ratio, len(positions)
    return dict(
        kv=torch.randn(rows, comp.width, generator=g),
        gate=torch.randn(rows, comp.width, generator=g),
        ring_kv=torch.randn(rows + 1, cap, comp.width, generator=g),
        ring_gate=torch.randn(rows + 1, cap, comp.width, generator=g),
        ape=comp.ape,
        slots=torch.arange(rows),
        positions=torch.tensor(positions),
        seq_lens=torch.tensor(positions) + 1,
    )


def _clone(step: dict) -> dict:
    return {k: v.clone() for k, v in step.items()}


def _pool_and_tables(rows: int, ratio: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_row = 2048 // BS
    tables = torch.randperm(rows * per_row, generator=g).int().view(rows, per_row)
    return torch.randn(rows * per_row, max(1, BS // ratio), 1, DIM, generator=g), tables


def _finish(comp: WindowCompressor, pool: torch.Tensor, tables: torch.Tensor) -> EntryFinish:
    rotary = comp.rotary
    return EntryFinish(
        comp.norm.weight,
        comp.norm.eps,
        rotary.inv_freq,
        rotary.magnitude,
        rotary.fp32_angles,
        ROT,
        pool,
        tables,
        BS,
    )


def _expected_pool(comp, step: dict, pool: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The torch form's pooled rows, normed and rotated by the compressor, stored where a row closes a window."""
    pooled = window_pool_decode_ref(**step, ratio=comp.ratio, overlap=comp.overlap)
    pos, r = step["positions"], comp.ratio
    finished = comp.rotary.rotate(comp.norm(pooled)[:, None], pos // r * r)[:, 0]
    pool = pool.clone()
    for row, p in enumerate(pos.tolist()):
        if step["slots"][row] >= 0 and (p + 1) % r == 0:
            pool[tables[row, p // BS], (p % BS) // r, 0] = finished[row]
    return pool


@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (8, False), (32, False)])
def test_torch_pool_is_the_compressors_pool_of_the_window(ratio: int, overlap: bool) -> None:
    comp = _compressor(ratio, overlap, False, seed=ratio)
    positions = [ratio - 1, 5 * ratio - 1, ratio + 1]
    step = _step(comp, positions, seed=ratio)
    before = _clone(step)
    out = window_pool_decode_ref(**step, ratio=ratio, overlap=overlap)
    assert float(out[2].abs().max()) == 0.0  # mid-window: nothing pooled
    cap = step["ring_kv"].shape[1]
    assert torch.equal(step["ring_kv"][1, positions[1] % cap], step["kv"][1])
    for r in (0, 1):
        pos = positions[r]
        first = max(0, pos - cap + 1)
        rows = [before["ring_kv"][r, p % cap] for p in range(first, pos)] + [step["kv"][r]]
        gates = [before["ring_gate"][r, p % cap] for p in range(first, pos)] + [step["gate"][r]]
        pooled = comp.pool(torch.stack(rows)[None], torch.stack(gates)[None], torch.tensor([pos // ratio]))[0]
        want = comp.finish(out[r][None], torch.tensor([pos // ratio]))[0]
        torch.testing.assert_close(want, pooled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp32_angles", [False, True])
@pytest.mark.parametrize(("ratio", "overlap"), [(4, True), (8, False), (32, False), (128, False)])
def test_fused_step_matches_torch_form(ratio: int, overlap: bool, fp32_angles: bool) -> None:
    """A span of 128 rows pools its 24 channels in two blocks (the row's norm spans both)."""
    comp = _compressor(ratio, overlap, fp32_angles, seed=ratio)
    # window 0 closing, later windows closing, a row mid-window, a padding row (slot -1)
    positions = [ratio - 1, 5 * ratio - 1, ratio + 1, 3 * ratio - 1, 9 * ratio - 1]
    step = _step(comp, positions, seed=ratio + 1)
    step["slots"][3] = -1
    pool, tables = _pool_and_tables(len(positions), ratio, seed=ratio)
    theirs = _clone(step)
    want = _expected_pool(comp, theirs, pool, tables)
    before = step["ring_kv"][3].clone()
    with torch.no_grad():
        window_compress_decode_triton(
            **step, ratio=ratio, overlap=overlap, finish=_finish(comp, pool, tables)
        )
    torch.testing.assert_close(pool, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(step["ring_kv"], theirs["ring_kv"]) and torch.equal(
        step["ring_gate"], theirs["ring_gate"]
    )
    assert torch.equal(step["ring_kv"][3], before)  # the padding row wrote nothing


def test_first_overlapping_window_reads_no_predecessor() -> None:
    """Window 0 of an overlapping pool has no previous window: whatever its ring slots hold is not read."""
    comp = _compressor(4, True, False, seed=3)
    step = _step(comp, [3], seed=3)
    pools = []
    for garbage in (False, True):
        pool, tables = _pool_and_tables(1, 4, seed=3)
        run = _clone(step)
        if garbage:
            run["ring_kv"][0, 4:] = 1e3  # the slots positions -4..-1 would map to
            run["ring_gate"][0, 4:] = 5.0
        with torch.no_grad():
            window_compress_decode_triton(**run, ratio=4, overlap=True, finish=_finish(comp, pool, tables))
        pools.append(pool)
    assert torch.equal(pools[0], pools[1])
