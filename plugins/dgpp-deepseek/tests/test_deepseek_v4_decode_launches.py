"""The launches of one batch-1 decode step of the bf16 ``deepseek_v4`` tiny checkpoint along the CUDA path
(``dgpp.bench.launches.count_decode``: Triton kernels run by the interpreter, torch ops counted as they would
launch), capped per layer kind: no host reads, and the glue that now rides in other launches stays out (the
fp32-weight norms' casts, the query's per-head RMS, the sqrt-softplus router's torch chain, the
hyper-connections' per-call weight pad and upcast, the top-k count's clamp, the shared expert's add), and the grouped output's blocks take the row-exact GEMV."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CUDA path's kernels run in Triton's interpreter"
)

# launches per layer (tiny checkpoint: sliding, HCA, CSA, CSA with the head collapse and the final norm);
# 69 / 71 / 89 / 93 with the torch glue
CAPS = (37, 39, 53, 52)
GONE = ("aten.to", "aten.square", "aten.mean", "aten.rsqrt", "aten.softplus", "aten.sqrt", "aten.gather")
GONE += ("aten.div", "aten.clamp", "aten.rms_norm", "aten.sort", "aten.constant_pad_nd")
GONE += (
    "aten.linear",
)  # the grouped wo_a's blocks take the fixed-order GEMV: cuBLAS rows depend on the batch


@pytest.fixture(scope="module")
def found():
    from dgpp.bench.launches import count_decode, tiny_model

    return count_decode(tiny_model("deepseek_v4", torch.bfloat16))


def test_decode_layers_launch_at_most_their_caps(found) -> None:
    counts = found.per_layer()
    assert len(counts) == len(CAPS) and all(counts), counts
    for i, (layer, cap) in enumerate(zip(found.layers, CAPS, strict=True)):
        assert sum(layer.values()) <= cap, (i, dict(layer))


def test_decode_step_reads_nothing_on_the_host(found) -> None:
    ops = [op for layer in found.layers for op in layer] + list(found.outside)
    assert not [op for op in ops if op.startswith("sync:")], ops


def test_the_folded_glue_launches_nothing_of_its_own(found) -> None:
    for i, layer in enumerate(found.layers):
        assert not [op for op in GONE if op in layer], (i, dict(layer))
        assert layer["router_topk"] == 1, (i, dict(layer))  # learned and hashed layers alike
        # 4 fp32-weight norms (attention input, q latent, K/V latent, MoE input) and 2 stream norms; the last layer
        # also its head collapse's stream norm and the final norm
        assert layer["rms_norm"] == (8 if i == len(found.layers) - 1 else 6), (i, dict(layer))
        assert layer["trailing_rotary"] == (4 if i >= 2 else 3), (i, dict(layer))  # CSA: the index query too
