"""The prefill GEMM tiles' pipelines fit an sm_90 SM's shared memory for every activation dtype they take.

Triton stages ``num_stages - 1`` copies of each K step's x tile and weight tiles (for the gate/up kernel's
128 x 128 x 64 tile at 4 stages: 196,608 bytes in bf16, 294,912 in fp32, as compiled for sm_90 by Triton 3.6); a
launch past 232,448 bytes fails on the device with ``OutOfResources``. The launches are captured here instead
of run, so this checks the pipeline each call asks for on any machine.
"""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels import gemm_prefill

SM90_SHARED_BYTES = 232_448


class _Launch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **meta)`` records ``meta``."""

    def __init__(self) -> None:
        self.meta: dict = {}

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.meta = meta

        return launch


def _staged_bytes(meta: dict, weight_tiles: int, element_size: int) -> int:
    per_step = (meta["BM"] + weight_tiles * meta["BN"]) * meta["BK"] * element_size
    return (meta["num_stages"] - 1) * per_step


def _gate_up(x: torch.Tensor) -> None:
    w = torch.empty(256, x.shape[1], dtype=x.dtype)
    gemm_prefill.prefill_gate_up_silu(x, w, w)


def _linear(x: torch.Tensor) -> None:
    gemm_prefill.prefill_linear(x, [torch.empty(256, x.shape[1], dtype=x.dtype)])


# (kernel, call, weight tiles a K step, the swept tile by row count)
KERNELS = {
    "gate_up": ("_prefill_gate_up_silu_kernel", _gate_up, 2, gemm_prefill.gate_up_tile),
    "linear": ("_prefill_linear_kernel", _linear, 1, gemm_prefill.linear_tile),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 512, 4096])
def test_pipeline_fits(monkeypatch, kernel, dtype, rows):
    name, call, weight_tiles, swept_tile = KERNELS[kernel]
    launch = _Launch()
    monkeypatch.setattr(gemm_prefill, name, launch)
    x = torch.empty(rows, 512, dtype=dtype)
    call(x)
    assert _staged_bytes(launch.meta, weight_tiles, x.element_size()) <= SM90_SHARED_BYTES
    if dtype == torch.bfloat16:  # the swept bf16 pipeline is kept as it was measured
        assert launch.meta["num_stages"] == swept_tile(rows)[4]
