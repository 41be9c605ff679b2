"""RMSNorm(+residual), rotary and SwiGLU: Triton (interpreter) against the torch references."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dgpp.kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from dgpp.kernels.rotary import rotary_ref, rotary_triton
from dgpp.kernels.swiglu import silu_and_mul_ref, silu_and_mul_triton, silu_mul_pair_triton


def _inv_freq(rot: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [64, 80])
def test_rms_norm_matches_reference(hidden: int, offset: float) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(5, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    torch.testing.assert_close(
        rms_norm_triton(x, w, 1e-6, None, offset), rms_norm_ref(x, w, 1e-6, None, offset)
    )


def test_rms_norm_reference_matches_nn_layer() -> None:
    from dgpp.nn.norm import RMSNorm

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    for zero_centered in (False, True):
        layer = RMSNorm(64, 1e-6, zero_centered=zero_centered, dtype=torch.bfloat16)
        layer.weight.data.copy_(torch.randn(64, generator=g))
        ref = rms_norm_ref(x, layer.weight, 1e-6, None, 1.0 if zero_centered else 0.0)
        assert torch.equal(ref, layer(x))


def test_fused_add_rms_norm_returns_sum_and_norm() -> None:
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    w = torch.randn(64, generator=g)
    out, res = rms_norm_triton(x, w, 1e-5, r)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(res, ref_res)
    torch.testing.assert_close(out, ref_out)
    assert out.shape == x.shape


def test_rms_norm_on_strided_rows() -> None:
    # per-head q/k norm runs on a [T, H, D] view of a wider projection output
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 3 * 32, generator=g)
    heads = wide[:, :64].view(4, 2, 32)
    w = torch.randn(32, generator=g)
    torch.testing.assert_close(rms_norm_triton(heads, w, 1e-6), rms_norm_ref(heads, w, 1e-6))


@pytest.mark.parametrize(("rot", "neox"), [(32, True), (32, False), (16, True), (16, False)])
def test_rotary_matches_reference(rot: int, neox: bool) -> None:
    g = torch.Generator().manual_seed(rot + neox)
    q, k = torch.randn(6, 4, 32, generator=g), torch.randn(6, 2, 32, generator=g)
    pos = torch.tensor([0, 5, 17, 3, 63, 1])
    inv = _inv_freq(rot)
    q_ref, k_ref = rotary_ref(q, k, pos, inv, 1.3, neox)
    q_tri, k_tri = rotary_triton(q, k, pos, inv, 1.3, neox)
    torch.testing.assert_close(q_tri, q_ref)
    torch.testing.assert_close(k_tri, k_ref)
    if rot < 32:  # channels past rotary_dim pass through untouched
        torch.testing.assert_close(q_tri[..., rot:], q[..., rot:])


def test_rotary_over_several_blocks_of_query_heads() -> None:
    """20 query heads take three programs a row (the last block ragged), k rotated once by the first; the partial
    rotary's pass-through channels of every head are written too."""
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(3, 20, 48, generator=g), torch.randn(3, 3, 48, generator=g)
    pos, inv = torch.tensor([4, 0, 29]), _inv_freq(16)
    q_ref, k_ref = rotary_ref(q, k, pos, inv, 1.0, True)
    q_tri, k_tri = rotary_triton(q, k, pos, inv, 1.0, True)
    torch.testing.assert_close(q_tri, q_ref)
    torch.testing.assert_close(k_tri, k_ref)


def test_rotary_without_rotated_dims_passes_q_and_k_through() -> None:
    """NoPE MLA (GLM-5.3-Flash) has an empty rope part: nothing to rotate, and no kernel of zero width to build."""
    q, k = torch.randn(3, 2, 0), torch.randn(3, 1, 0)
    q_out, k_out = rotary_triton(q, k, torch.tensor([0, 1, 2]), torch.empty(0))
    assert q_out.shape == q.shape and k_out.shape == k.shape


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rotary_reference_matches_nn_rotary_layer(style: str) -> None:
    # the reference against dgpp.nn's RotaryEmbedding (HF rotate_half / GPT-J interleaving), partial dims
    from dgpp.nn.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(3, 2, 32, generator=g), torch.randn(3, 1, 32, generator=g)
    pos = torch.tensor([1, 4, 900])
    layer = RotaryEmbedding(32, 16, 10000.0, style=style)
    q_nn, k_nn = layer(pos, q, k)
    q_ref, k_ref = rotary_ref(q, k, pos, layer.inv_freq, layer.magnitude, style == "half")
    torch.testing.assert_close(q_ref, q_nn)
    torch.testing.assert_close(k_ref, k_nn)


def test_silu_mul_pair_on_separate_projections() -> None:
    g = torch.Generator().manual_seed(4)
    gate, up = torch.randn(3, 70, generator=g), torch.randn(3, 70, generator=g)
    torch.testing.assert_close(silu_mul_pair_triton(gate, up), torch.nn.functional.silu(gate) * up)


def test_silu_and_mul_matches_reference() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, 2 * 1100, generator=g)  # two column blocks, ragged tail
    out = silu_and_mul_triton(x)
    assert out.shape == (3, 2, 1100)
    torch.testing.assert_close(out, silu_and_mul_ref(x))
    gate, up = x[..., :1100], x[..., 1100:]
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize(("rot", "neox", "offset"), [(32, True, 0.0), (16, True, 1.0), (32, False, 0.0)])
def test_qk_norm_rope_equals_norm_then_rotary(rot: int, neox: bool, offset: float) -> None:
    from dgpp.kernels.qk_norm_rope import qk_norm_rope_ref, qk_norm_rope_triton

    g = torch.Generator().manual_seed(rot + 7 * neox)
    # q as a strided view (per-head [q|gate] packing), k contiguous
    packed = torch.randn(5, 4, 64, generator=g)
    q, k = packed[..., :32], torch.randn(5, 2, 32, generator=g)
    qw, kw = torch.randn(32, generator=g), torch.randn(32, generator=g)
    pos = torch.tensor([0, 3, 99, 7, 1000])
    inv = _inv_freq(rot)
    q_tri, k_tri = qk_norm_rope_triton(q, k, qw, kw, 1e-6, offset, pos, inv, 1.0, neox)
    q_ref, k_ref = qk_norm_rope_ref(q, k, qw, kw, 1e-6, offset, pos, inv, 1.0, neox)
    torch.testing.assert_close(q_tri, q_ref)
    torch.testing.assert_close(k_tri, k_ref)
    q_two, _ = rotary_triton(
        rms_norm_triton(q, qw, 1e-6, None, offset),
        rms_norm_triton(k, kw, 1e-6, None, offset),
        pos,
        inv,
        1.0,
        neox,
    )
    torch.testing.assert_close(q_tri, q_two)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp32_product_is_weight_times_normed_sum(with_residual: bool) -> None:
    # plain weights with the product in fp32 (gpt-oss / Flint order), fused with the residual add
    g = torch.Generator().manual_seed(11)
    x, r = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    w = torch.randn(96, generator=g)
    summed = x + r if with_residual else x
    expected = (w.float() * torch.nn.functional.rms_norm(summed.float(), (96,), eps=1e-5)).to(x.dtype)
    got = rms_norm_triton(x, w, 1e-5, r if with_residual else None, 0.0, True)
    ref = rms_norm_ref(x, w, 1e-5, r if with_residual else None, 0.0, True)
    if with_residual:
        (got, got_sum), (ref, ref_sum) = got, ref
        assert torch.equal(got_sum, summed) and torch.equal(ref_sum, summed)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-6)


def test_rms_norm_layer_with_fp32_product_runs_the_kernel_order() -> None:
    from dgpp.nn.norm import RMSNorm, add_rms_norm

    class Fp32ProductNorm(RMSNorm):
        fp32_product = True

    g = torch.Generator().manual_seed(12)
    norm = Fp32ProductNorm(64, 1e-6, dtype=torch.float32)
    norm.weight.data.copy_(torch.randn(64, generator=g))
    x, r = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
    assert norm.kernel_numerics() == (0.0, True)
    expected = (norm.weight.float() * torch.nn.functional.rms_norm(x + r, (64,), eps=1e-6)).to(x.dtype)
    out, summed = add_rms_norm(x, r, norm)  # the CPU path: the add, then the layer
    assert torch.equal(out, expected) and torch.equal(summed, r + x)
    fused, fused_sum = rms_norm_triton(x, norm.weight, norm.eps, r, *norm.kernel_numerics())
    torch.testing.assert_close(fused, out, rtol=1e-5, atol=1e-6)
    assert torch.equal(fused_sum, summed)


def test_unweighted_norm_writes_the_asked_dtype() -> None:
    """``unweighted_rms_norm`` (the hyper-connections' fp32 x̂ of bf16 streams): one launch, ``x̂`` in fp32 within
    fp32 rounding of ``rms_norm`` of the upcast; a large eps on a small row shows the eps is added."""
    from dgpp.kernels import rmsnorm

    g = torch.Generator().manual_seed(13)
    x = (
        torch.randn(5, 200, generator=g).bfloat16()
        * torch.tensor([1.0, 3.0, 0.01, 1.0, 7.0]).bfloat16()[:, None]
    )
    got = rmsnorm.rms_norm_triton(x, None, 0.01, fp32_product=True, out_dtype=torch.float32)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    want = torch.nn.functional.rms_norm(x.float(), (200,), eps=0.01)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert (got[2] - torch.nn.functional.rms_norm(x[2].float(), (200,))).abs().max() > 0.1
    assert torch.equal(rmsnorm.unweighted_rms_norm(x, 0.01, torch.float32), want)  # CPU: torch's own
    with pytest.raises(ValueError, match="residual"):
        rmsnorm.rms_norm_triton(x, None, 0.01, x, out_dtype=torch.float32)


def test_fp32_weight_norm_takes_one_launch_of_the_same_order() -> None:
    """DeepSeek-V4's fp32-weight norm on its CUDA branch: the fp32-product kernel, which writes bf16 rows
    within one bf16 rounding of the torch chain (upcast, norm, fp32 product, cast back) and fp32 rows within
    fp32 rounding; the weight scales the rows."""
    from dgpp.bench.launches import cuda_path
    from dgpp.nn.window_compressor import FP32WeightRMSNorm

    g = torch.Generator().manual_seed(14)
    norm = FP32WeightRMSNorm(96, 1e-6)
    norm.weight.data.copy_(torch.randn(96, generator=g))
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 2**-7)):
        x = torch.randn(3, 96, generator=g).to(dtype)
        want = norm(x)
        with cuda_path() as recorder:
            recorder.target = launches = Counter()
            got = norm(x)
        assert launches == Counter({"rms_norm": 1})
        assert got.dtype == dtype
        assert ((got.float() - want.float()).abs() <= tol * (1 + want.float().abs())).all()
    unit = FP32WeightRMSNorm(96, 1e-6)
    unit.weight.data.fill_(1.0)
    assert (got.float() - unit(x).float()).abs().max() > 0.1


def test_qk_norm_rope_fp32_product_equals_its_norm_then_rotary() -> None:
    from dgpp.kernels.qk_norm_rope import qk_norm_rope_triton

    g = torch.Generator().manual_seed(13)
    q, k = torch.randn(3, 4, 32, generator=g), torch.randn(3, 2, 32, generator=g)
    qw, kw = torch.randn(32, generator=g), torch.randn(32, generator=g)
    pos, inv = torch.tensor([0, 5, 77]), _inv_freq(32)

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w.float() * torch.nn.functional.rms_norm(x.float(), (32,), eps=1e-6)).to(x.dtype)

    q_ref, k_ref = rotary_ref(norm(q, qw), norm(k, kw), pos, inv, 1.0, True)
    q_tri, k_tri = qk_norm_rope_triton(q, k, qw, kw, 1e-6, 0.0, pos, inv, 1.0, True, True)
    torch.testing.assert_close(q_tri, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_tri, k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float64])
def test_gated_rms_norm_matches_reference(sigmoid: bool, x_dtype: torch.dtype) -> None:
    from dgpp.kernels.gated_rmsnorm import GatedRmsNormInputs, gated_rms_norm_ref, gated_rms_norm_triton

    g = torch.Generator().manual_seed(21 + sigmoid)
    # x: the delta rule's output in its own dtype; gate: a strided view of a wider projection
    x = torch.randn(3, 4, 48, generator=g, dtype=torch.float64).to(x_dtype)
    gate = torch.randn(3, 4 * 48 + 8, generator=g)[:, : 4 * 48].view(3, 4, 48)
    w = torch.randn(48, generator=g)
    got = gated_rms_norm_triton(GatedRmsNormInputs(x, gate, w, 1e-6, torch.float32, sigmoid))
    ref = gated_rms_norm_ref(GatedRmsNormInputs(x, gate, w, 1e-6, torch.float32, sigmoid))
    act = torch.sigmoid(gate) if sigmoid else torch.nn.functional.silu(gate)
    xf = x.float()
    explicit = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)) * act
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, explicit, rtol=1e-5, atol=1e-6)


def test_gated_rms_norm_layer_on_both_paths() -> None:
    from dgpp.kernels.gated_rmsnorm import GatedRmsNormInputs, gated_rms_norm_triton
    from dgpp.nn.gated_deltanet import GatedRMSNorm

    g = torch.Generator().manual_seed(23)
    norm = GatedRMSNorm(32, 1e-6)
    norm.weight.data.copy_(torch.randn(32, generator=g))
    x, gate = torch.randn(2, 3, 32, generator=g), torch.randn(2, 3, 32, generator=g)
    torch.testing.assert_close(
        gated_rms_norm_triton(GatedRmsNormInputs(x, gate, norm.weight, norm.eps, torch.float32)),
        norm(x, gate),
        rtol=1e-5,
        atol=1e-6,
    )


def test_gdn_gates_match_reference() -> None:
    from dgpp.kernels.gdn_gates import gdn_gates_ref, gdn_gates_triton

    g = torch.Generator().manual_seed(22)
    wide = torch.randn(5, 2 * 6, generator=g) * 12  # b and a side by side: strided rows; past softplus' bends
    b, a = wide[:, :6], wide[:, 6:]
    a[0, 0], a[1, 1] = 30.0, -40.0  # above torch's threshold, and where 1 + e^x rounds to 1
    A_log, dt_bias = torch.randn(6, generator=g), torch.randn(6, generator=g)
    g_tri, beta_tri = gdn_gates_triton(a, b, A_log, dt_bias)
    g_ref, beta_ref = gdn_gates_ref(a, b, A_log, dt_bias)
    torch.testing.assert_close(g_tri, g_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(beta_tri, beta_ref, rtol=1e-5, atol=1e-7)
    assert g_tri[1, 1] < 0  # e^x kept where log(1 + e^x) would give 0


def test_sigmoid_gate_reads_the_strided_gate_in_place() -> None:
    from dgpp.kernels.output_gate import sigmoid_gate_ref, sigmoid_gate_triton
    from dgpp.nn.attention import split_query_gate

    g = torch.Generator().manual_seed(31)
    q_proj_out = torch.randn(3, 4 * 2 * 24, generator=g)
    _, gate = split_query_gate(q_proj_out, 4, 24)  # a strided [T, H, D] view
    attn = torch.randn(3, 4 * 24, generator=g)
    got = sigmoid_gate_triton(attn, gate)
    expected = attn * torch.sigmoid(q_proj_out.view(3, 4, 48)[..., 24:]).reshape(3, 96)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(sigmoid_gate_ref(attn, gate), expected, rtol=0, atol=0)


def test_shared_expert_add_matches_the_chain() -> None:
    from dgpp.kernels.output_gate import shared_expert_add_ref, shared_expert_add_triton

    g = torch.Generator().manual_seed(32)
    routed, shared = torch.randn(3, 80, generator=g), torch.randn(3, 80, generator=g)
    gate = torch.randn(3, 5, generator=g)[:, 2:3]  # one logit per token, a column of a wider output
    got = shared_expert_add_triton(routed, shared, gate)
    torch.testing.assert_close(got, routed + torch.sigmoid(gate) * shared, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shared_expert_add_ref(routed, shared, gate), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("limit", [1.5, 0.7])  # 0.7: not a bf16 value, the clamped entries round to one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_pair_clamps_as_torch_clamp_would(limit: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    gate, up = (
        (torch.randn(3, 96, generator=g) * 3).to(dtype),
        (torch.randn(3, 96, generator=g) * 3).to(dtype),
    )
    gate[0, 0] = float("nan")
    got = silu_mul_pair_triton(gate, up, limit)
    want = silu_mul_pair_triton(gate.clamp(max=limit), up.clamp(min=-limit, max=limit))
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[0, 0].isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert not torch.equal(got.nan_to_num(), silu_mul_pair_triton(gate, up).nan_to_num())  # the clamp bites
