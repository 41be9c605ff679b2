"""Prefill chunks' dense products written in place: each chunk still in calls of its own, into one output.

Outside ``batch_invariant`` the rows of a prefill chunk go through cuBLAS (the decode GEMV for chunks of at most
64 rows) in calls of their own, so a prompt row depends on its own chunk only (``dgpp.nn.exact.routing``). With
many short prompts in one step (a burst of 64 x 128-token prompts) that is 64 calls per weight and layer, and
the stock merge added a copy of every chunk's rows per output plus a SwiGLU per chunk: some 14 launches per chunk
and layer (Qwen3-8B), issued by the engine thread while the GPU waited. Here each chunk's product writes straight
into its rows of the step's output (``torch.mm(..., out=)``: the call ``F.linear`` makes, at an output address of
the same alignment class) and the SwiGLU runs once over every chunk row (it is elementwise): 7 launches per chunk
and layer, computing the same bits.
"""

from __future__ import annotations

import torch

ALIGN = (
    256  # bytes: cuBLAS(Lt) picks kernels by pointer alignment up to this; a fresh allocation has at least it
)
IN_PLACE = True  # False: the per-chunk calls and copies of ``routing.route_rows`` (A/B timing only)


def _aligned(x: torch.Tensor, ranges: tuple[tuple[int, int], ...], widths: list[int]) -> bool:
    """Every chunk's output rows start at an address aligned like a fresh tensor's (so cuBLAS sees the same call)."""
    elem = x.element_size()
    return IN_PLACE and all(a * n * elem % ALIGN == 0 for a, _ in ranges for n in widths)


def chunk_linears(
    x: torch.Tensor, weights: list[torch.Tensor], ranges: tuple[tuple[int, int], ...]
) -> list[torch.Tensor] | None:
    """``[x @ w.T]`` over the rows of ``ranges`` (other rows left unwritten), each range as the stock bulk path
    computes it alone; None when an output address would change alignment (the caller merges copies instead)."""
    from dgpp import kernels

    widths = [w.shape[0] for w in weights]
    if not _aligned(x, ranges, widths):
        return None
    outs = [x.new_empty(x.shape[0], n) for n in widths]
    for a, b in ranges:
        rows = x[a:b]
        if kernels.gemv_applies(rows, *weights):  # a short chunk: the decode GEMV, as the stock path
            for out, part in zip(outs, kernels.multi_linear(rows, weights), strict=True):
                out[a:b] = part
            continue
        for out, w in zip(outs, weights, strict=True):
            torch.mm(rows, w.t(), out=out[a:b])
    return outs


def chunk_gate_up_silu(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, ranges: tuple[tuple[int, int], ...]
) -> list[torch.Tensor] | None:
    """``silu(x wg^T) * (x wu^T)`` over the rows of ``ranges`` as ``chunk_linears`` computes products: gate and
    up per chunk in place, then one SwiGLU pass over all rows; None as ``chunk_linears``."""
    from dgpp import kernels

    inter = w_gate.shape[0]
    if not _aligned(x, ranges, [inter]):
        return None
    gate, up = x.new_empty(x.shape[0], inter), x.new_empty(x.shape[0], inter)
    short = []
    for a, b in ranges:
        rows = x[a:b]
        if kernels.gemv_applies(rows, w_gate, w_up):  # the fused decode kernel, as the stock path
            short.append((a, b, kernels.gate_up_silu(rows, w_gate, w_up)))
            continue
        torch.mm(rows, w_gate.t(), out=gate[a:b])
        torch.mm(rows, w_up.t(), out=up[a:b])
    # one elementwise pass over every row: the rows of no chunk (decode rows) hold garbage the caller overwrites
    out = kernels.silu_mul_pair(gate, up)
    for a, b, part in short:
        out[a:b] = part
    return [out]
