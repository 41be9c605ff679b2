"""CPU decode paths keep a row's bits independent of the rows beside it (solo == batched == chunked)."""

from __future__ import annotations

import pytest
import torch

from dgpp.nn.mlp import silu_and_mul

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 64, 576, 1536, 3072])
def test_swiglu_row_alone_equals_the_row_among_many(dtype, width):
    total = 300
    gate = (torch.randn(total, width, generator=GEN) * 4).to(dtype)
    up = torch.randn(total, width, generator=GEN).to(dtype)
    full = silu_and_mul(gate, up)
    for rows in [*range(1, 12), 31, 63, 64, 65, 100, total]:
        assert torch.equal(silu_and_mul(gate[:rows], up[:rows]), full[:rows]), rows
    for row in range(0, total, 7):
        assert torch.equal(silu_and_mul(gate[row : row + 1], up[row : row + 1]), full[row : row + 1]), row
