"""Matrix products whose every output row is the same whatever other rows share the call.

On the CPU, ``F.linear`` picks a different GEMM kernel for 1-3, 5-7 and 9-11 rows (and for a single
output feature) than for larger shapes, so a token's logits could change in the last bit with the
number of tokens in the step (or routed to an expert) — enough to flip a greedy near-tie between a
batched and a solo run. Padding both the rows and the output features up to ``MIN_GEMM_DIM`` with
zeros always takes the large-shape kernel, whose rows measured bit-identical for every row count
(1..300) and shape tried. The padding costs nothing measurable at these sizes; CUDA has its own
kernels and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

MIN_GEMM_DIM = 16


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows independent of the batch (see module docstring)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows, out_features = x.numel() // x.shape[-1], weight.shape[0]
    flat = x.reshape(rows, x.shape[-1])
    if rows < MIN_GEMM_DIM:
        flat = F.pad(flat, (0, 0, 0, MIN_GEMM_DIM - rows))
    w = weight if out_features >= MIN_GEMM_DIM else F.pad(weight, (0, 0, 0, MIN_GEMM_DIM - out_features))
    out = F.linear(flat, w)[:rows, :out_features]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


ROW_MULTIPLE = 64


def batch_invariant_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for a row-wise / elementwise ``fn`` of ``x [rows, n]``, each row's result independent of
    ``rows``. CPU elementwise kernels (``torch.sigmoid``, ``F.silu``) treat a tensor's vector tail apart from
    its body, so a row's last bit could depend on how many rows came with it; padding the rows to a multiple
    of ``ROW_MULTIPLE`` keeps every element of a row on the same side (measured for widths 8..512, 1..70 rows)."""
    if x.device.type != "cpu" or x.dim() != 2:
        return fn(x)
    rows = x.shape[0]
    pad = -rows % ROW_MULTIPLE
    return fn(F.pad(x, (0, 0, 0, pad)))[:rows] if pad else fn(x)
