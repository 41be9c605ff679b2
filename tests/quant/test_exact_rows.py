"""Packed linears through a step's exactness route (``dgpp.quant.linear``), on the CPU under the Triton
interpreter: the route is set by hand and ``exact_cuda.routable`` is told to accept CPU tensors (on a GPU the
model step sets both; tests/perf/check_exact_cuda.py checks the kernels there). Canonical rows must equal the
same row computed alone at any step size; prefill-chunk rows must not depend on the chunk's length."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
import torch.nn.functional as F

from dgpp.nn.exact import routing as exact_cuda
from dgpp.quant.fp4 import NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.linear import decode_rows, layer_tensors, routed_packed_gate_up_silu, routed_packed_linears
from dgpp.step.route import in_flight, route_for

from .gemv_cases import packed_layer

K = 128


@pytest.fixture
def route(monkeypatch):
    """Set a step's route for rows of ``q_lens``; CPU tensors count as routable."""
    monkeypatch.setattr(exact_cuda, "routable", lambda x, weights: x.dim() == 2 and x.shape[0] > 0)
    with ExitStack() as steps:

        def set_route(q_lens: list[int]) -> None:
            steps.enter_context(in_flight(route_for(q_lens, "cpu")))

        yield set_route


def _dense(layers) -> torch.Tensor:
    return torch.cat([lyr.quant_method.dense_weight(lyr, torch.float32) for lyr in layers])


ROUTED_FORMATS = [
    FP8Block(block=(16, 64)),
    NVFP4ModelOpt(),
    IntPacked(bits=4, group=64),
    GPTQ(bits=4, group=64),
]


@pytest.mark.parametrize("fmt", ROUTED_FORMATS, ids=lambda f: f.name)
def test_mixed_step_decode_rows_are_canonical_and_prompt_rows_follow_their_chunk(fmt, route):
    layers = tuple(packed_layer(fmt, n, K, i) for i, n in enumerate((48, 16, 16)))
    sets, shapes = layer_tensors(layers)
    q_lens = [1, 20, 1, 13]  # decode, a 20-row prompt, decode, a 13-row chunk of the same prompt
    x = torch.randn(sum(q_lens), K)
    x[22:35] = x[1:14]
    route(q_lens)
    got = torch.cat(routed_packed_linears(layers, x), 1)
    torch.testing.assert_close(got, x @ _dense(layers).t(), rtol=1e-5, atol=1e-5)
    for r in (0, 21):  # decode rows: the bits of the row alone
        assert torch.equal(got[r], torch.cat(decode_rows(fmt, sets, x[r : r + 1], shapes), 1)[0])
    # the 13-row chunk computes its rows like the first 13 rows of the one-shot prompt
    assert torch.equal(got[22:35], got[1:14])


def test_more_than_16_decode_rows_each_equal_the_row_alone(route):
    fmt = NVFP4ModelOpt()
    layers = (packed_layer(fmt, 32, K, 0),)
    sets, shapes = layer_tensors(layers)
    route([1] * 20)  # two launches of the decode GEMV
    x = torch.randn(20, K)
    got = routed_packed_linears(layers, x)[0]
    for r in range(20):
        assert torch.equal(got[r], decode_rows(fmt, sets, x[r : r + 1], shapes)[0][0])


@pytest.mark.parametrize("fmt", [NVFP4ModelOpt(), IntPacked(bits=8, group=64)], ids=lambda f: f.name)
def test_gate_up_silu_through_the_route(route, fmt):
    gate, up = packed_layer(fmt, 32, K, 1), packed_layer(fmt, 32, K, 2)
    q_lens = [1, 18, 1]
    x = torch.randn(sum(q_lens), K)
    route(q_lens)
    got = routed_packed_gate_up_silu(gate, up, x)
    want = F.silu(x @ _dense((gate,)).t()) * (x @ _dense((up,)).t())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = routed_packed_gate_up_silu(gate, up, x[19:20])  # a row set of its own is canonical
    assert torch.equal(got[19], alone[0])


def test_no_route_leaves_the_caller_its_own_path(monkeypatch):
    monkeypatch.setattr(exact_cuda, "routable", lambda x, weights: True)
    layers = (packed_layer(NVFP4ModelOpt(), 16, K, 0),)
    with in_flight(None):
        assert routed_packed_linears(layers, torch.randn(3, K)) is None
