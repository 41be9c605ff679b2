"""Shared layers against transformers' own implementations (or the formula, where none exists)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

from dgpp.nn.attention import gated_output, split_query_gate
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding, YarnScaling

GEN = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rmsnorm_matches_transformers_bit_for_bit(dtype, zero_centered):
    x, w = randn(5, 64, dtype=dtype), randn(64, dtype=dtype)
    ours = RMSNorm(64, 1e-6, zero_centered=zero_centered, dtype=dtype)
    ref = hf_qwen35.Qwen3_5RMSNorm(64, eps=1e-6) if zero_centered else hf_qwen3.Qwen3RMSNorm(64, eps=1e-6)
    ref = ref.to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
        assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("rotary_dim", [16, 4])
def test_rotate_half_rotary_matches_transformers(rotary_dim):
    T, H, D = 7, 3, 16
    q, k = randn(T, H, D), randn(T, 1, D)
    positions = torch.tensor([0, 1, 2, 9, 10, 100, 511])
    rope = RotaryEmbedding(D, rotary_dim, 10000.0)
    oq, ok = rope(positions, q, k)
    inv = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = positions[:, None].float() * inv
    emb = torch.cat((freqs, freqs), -1)
    apply = hf_qwen3.apply_rotary_pos_emb if rotary_dim == D else hf_qwen35.apply_rotary_pos_emb
    rq, rk = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    torch.testing.assert_close(oq, rq[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ok, rk[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "style, rotary_dim", [("half", 16), ("half", 8), ("interleaved", 16), ("interleaved", 8)]
)
def test_rotation_has_the_bits_of_the_reference_formula(dtype, style, rotary_dim):
    """The CPU rotation (q and k as one tensor, the sign folded into sin) gives ``x * cos + rotate(x) * sin``'s
    bits exactly, in the activation dtype, for both styles and partial rotary."""
    T, D = 9, 16
    q, k = (randn(T, 3, D) * 3).to(dtype), (randn(T, 1, D) * 3).to(dtype)
    positions = torch.tensor([0, 1, 2, 9, 10, 100, 511, 4000, 8191])
    rope = RotaryEmbedding(D, rotary_dim, 1e5, style=style)
    cos, sin = rope.cos_sin(positions, dtype)

    def reference(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
        if style == "half":
            first, second = rot.chunk(2, dim=-1)
            turned = torch.cat((-second, first), dim=-1)
        else:
            turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat((rot * cos[:, None, :] + turned * sin[:, None, :], rest), dim=-1)

    oq, ok = rope(positions, q, k)
    assert torch.equal(oq, reference(q)) and torch.equal(ok, reference(k))
    assert torch.equal(rope.rotate(q, cos, sin), reference(q))


def test_interleaved_rotary_is_complex_multiplication():
    T, H, D = 5, 2, 8
    q = randn(T, H, D, dtype=torch.float64).float()
    positions = torch.arange(3, 3 + T)
    rope = RotaryEmbedding(D, D, 500.0, style="interleaved")
    out, _ = rope(positions, q, q[:, :1])
    angle = positions[:, None].double() * (1.0 / 500.0 ** (torch.arange(0, D, 2).double() / D))
    z = (
        torch.view_as_complex(q.double().reshape(T, H, D // 2, 2).contiguous())
        * torch.polar(torch.ones_like(angle), angle)[:, None]
    )
    torch.testing.assert_close(out.double(), torch.view_as_real(z).reshape(T, H, D), rtol=0, atol=1e-5)


def test_yarn_frequencies_and_magnitude_match_transformers():
    params = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.25,
    }
    cfg = transformers.Qwen3_5TextConfig(head_dim=256, max_position_embeddings=16384, rope_parameters=params)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    yarn = YarnScaling(factor=4.0, original_max_position=4096)
    torch.testing.assert_close(yarn.inv_freq(1e6, 64), ref_inv, rtol=1e-6, atol=0)
    assert yarn.magnitude() == pytest.approx(ref_scale)
    rope = RotaryEmbedding(256, 64, 1e6, yarn=yarn)
    cos, _ = rope.cos_sin(torch.tensor([0]), torch.float32)
    assert cos[0, 0].item() == pytest.approx(ref_scale)


def test_mrope_section_must_cover_the_rotary_dims():
    RotaryEmbedding(256, 64, 1e7, mrope_section=(11, 11, 10))
    with pytest.raises(ValueError, match="mrope_section"):
        RotaryEmbedding(256, 64, 1e7, mrope_section=(16, 16, 16))


def test_query_gate_split_follows_per_head_packing():
    H, D = 3, 4
    packed = torch.arange(2 * 2 * H * D, dtype=torch.float32).view(2, 2 * H * D)
    q, gate = split_query_gate(packed, H, D)
    ref_q, ref_gate = torch.chunk(packed.view(2, H, 2 * D), 2, dim=-1)
    assert torch.equal(q, ref_q) and torch.equal(gate, ref_gate)
    assert torch.equal(gated_output(torch.ones(2, H * D), gate), torch.sigmoid(gate).reshape(2, H * D))


@pytest.mark.parametrize("out_features, in_features", [(1, 64), (8, 64), (64, 64), (512, 64), (33, 77)])
def test_batch_invariant_linear_rows_do_not_depend_on_the_row_count(out_features, in_features):
    from dgpp.nn.batch_invariant import ROW_BATCH, batch_invariant_linear

    total = ROW_BATCH + 44  # past one batched piece of rows
    w, x, b = randn(out_features, in_features), randn(total, in_features), randn(out_features)
    full = batch_invariant_linear(x, w, b)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), rtol=1e-6, atol=1e-5)
    for rows in [*range(1, 40), ROW_BATCH - 1, ROW_BATCH, ROW_BATCH + 1, total]:
        assert torch.equal(batch_invariant_linear(x[:rows], w, b), full[:rows]), rows
    for row in range(0, total, 13):  # a row alone (the decode GEMV) equals the same row among many
        assert torch.equal(batch_invariant_linear(x[row : row + 1], w, b), full[row : row + 1]), row


def test_narrow_cpu_weights_multiply_in_fp32_and_follow_in_place_updates(monkeypatch):
    from dgpp.nn import batch_invariant
    from dgpp.nn.batch_invariant import batch_invariant_linear

    # a CPU whose narrow product failed the row check for this shape: the weight multiplies in fp32
    key = (torch.bfloat16, 48, 1536, torch.get_num_threads())
    monkeypatch.setitem(batch_invariant._native_verdicts, key, (0, False))
    w = torch.nn.Parameter(randn(48, 1536).to(torch.bfloat16), requires_grad=False)
    x = randn(5, 1536).to(torch.bfloat16)

    def want() -> torch.Tensor:  # each row's fp32 GEMV, rounded once
        rows = [torch.nn.functional.linear(x[i : i + 1].float(), w.float()) for i in range(x.shape[0])]
        return torch.cat(rows).to(torch.bfloat16)

    assert torch.equal(batch_invariant_linear(x, w), want())
    with torch.no_grad():
        w.mul_(2)  # the fp32 copy is rebuilt after an in-place change
    assert torch.equal(batch_invariant_linear(x, w), want())
