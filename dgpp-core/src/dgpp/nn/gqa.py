"""Grouped-query self-attention block over the paged KV: q/k/v projections (optionally biased), optional
per-head q/k RMSNorm (plain or zero-centred), (partial) RoPE, paged attention, optional sigmoid output gate,
``o_proj``.

The shape Llama-style families share (GLM-4.x, Qwen3, Qwen3.5's gated full attention): heads split over TP
ranks (q/k/v column-, o_proj row-parallel; the caller all-reduces the output once per block). With
``output_gate`` the q projection is ``[q|gate]`` per head (Qwen3.5), so a column slice still holds whole
heads with their gates. On CUDA, decode rows take q, k and v in one Triton GEMV when the projections are
plain dense weights without bias (on the CPU: one row-wise product against the concatenated weights), and with q/k norm and a power-of-two rotary dim the norms and the
rotation run as one Triton launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dgpp.family import World
from dgpp.nn.attention import PagedAttention, gated_output, split_query_gate
from dgpp.nn.batch_invariant import batch_invariant_fused_linear
from dgpp.nn.linear import Linear, fused_linears
from dgpp.nn.mlp import cpu_fusable, dense_weights
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.step.batch import ForwardBatch


class GQAttention(nn.Module):
    """``o_proj(gate * attn(rope(norm(q)), rope(norm(k)), v))`` for one layer; K/V go to pool entry ``cache_name``.

    Parameter names follow HF checkpoints (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``q_norm``,
    ``k_norm``). ``qk_norm=False`` leaves ``q_norm``/``k_norm`` as None; ``output_gate=False`` means no gate.
    ``o_bias`` is separate from ``qkv_bias`` because GLM biases only q/k/v while Qwen biases all four.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        cache_name: str,
        *,
        dtype: torch.dtype,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        zero_centered_norm: bool = False,
        output_gate: bool = False,
        norm_eps: float = 1e-6,
        world: World | None = None,
    ) -> None:
        super().__init__()
        world = world or World()
        if num_heads % world.size or num_kv_heads % world.size:
            raise ValueError(
                f"{num_heads} q / {num_kv_heads} kv heads do not split over TP world {world.size}"
            )
        self.num_heads = num_heads // world.size
        self.num_kv_heads = num_kv_heads // world.size
        self.head_dim = head_dim
        self.output_gate = output_gate
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        kv_out = num_kv_heads * head_dim
        self.q_proj = Linear(hidden_size, q_out, bias=qkv_bias, dtype=dtype, parallel="column", world=world)
        self.k_proj = Linear(hidden_size, kv_out, bias=qkv_bias, dtype=dtype, parallel="column", world=world)
        self.v_proj = Linear(hidden_size, kv_out, bias=qkv_bias, dtype=dtype, parallel="column", world=world)
        self.o_proj = Linear(
            num_heads * head_dim, hidden_size, bias=o_bias, dtype=dtype, parallel="row", world=world
        )
        self.q_norm = (
            RMSNorm(head_dim, norm_eps, zero_centered=zero_centered_norm, dtype=dtype) if qk_norm else None
        )
        self.k_norm = (
            RMSNorm(head_dim, norm_eps, zero_centered=zero_centered_norm, dtype=dtype) if qk_norm else None
        )
        self.rotary = rotary
        self.attn = PagedAttention(cache_name, self.num_heads, self.num_kv_heads, head_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The raw q (``[q|gate]`` when gated), k and v projections of ``x``, flat per row."""
        return project_qkv(x, (self.q_proj, self.k_proj, self.v_proj))

    def split_heads(
        self, q_out: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """``(q, gate, k, v)`` per head: q ``[rows, Hq, D]``, gate as ``split_query_gate`` gives it or None."""
        rows = q_out.shape[0]
        if self.output_gate:
            q, gate = split_query_gate(q_out, self.num_heads, self.head_dim)
        else:
            q, gate = q_out.view(rows, self.num_heads, self.head_dim), None
        k = k_out.view(rows, self.num_kv_heads, self.head_dim)
        v = v_out.view(rows, self.num_kv_heads, self.head_dim)
        return q, gate, k, v

    def norm_and_rotate(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm_and_rotate(q, k, positions, self.q_norm, self.k_norm, self.rotary)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, gate, k, v = self.split_heads(*self.project(x))
        q, k = self.norm_and_rotate(q, k, batch.positions)
        out = self.attn(q, k, v, batch)
        if gate is not None:
            out = gated_output(out, gate)
        return self.o_proj(out)


def project_qkv(
    x: torch.Tensor, projections: tuple[Linear, Linear, Linear], *, fuse_on_cpu: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_proj(x), k_proj(x), v_proj(x))`` as ``fused_projections`` computes them."""
    q, k, v = fused_projections(x, projections, fuse_on_cpu=fuse_on_cpu)
    return q, k, v


def fused_projections(
    x: torch.Tensor, projections: Sequence[Linear], *, fuse_on_cpu: bool = True
) -> list[torch.Tensor]:
    """``[p(x) for p in projections]`` (one to three). On CUDA, dense unbiased projections run as one Triton
    launch (each output's reduction is the single weight's, so the values are those of separate launches) and
    packed ones as one fused launch; on the CPU, with ``fuse_on_cpu``, packed ones fused likewise and dense ones
    as one row-wise product against the concatenated weights (without it, one product per projection)."""
    if x.is_cuda and dense_weights(*projections):  # decode rows: the projections in one Triton launch
        from dgpp import kernels
        from dgpp.nn.exact import routing as exact_cuda

        weights = [p.weight for p in projections]
        routed = exact_cuda.routed_linears(x, weights, lambda rows: kernels.multi_linear(rows, weights))
        if routed is not None:  # canonical rows through the fixed-order kernel (dgpp.nn.exact.routing)
            return list(routed)
        if kernels.gemv_applies(x, *weights):
            return list(kernels.multi_linear(x, weights))
    elif x.is_cuda or (fuse_on_cpu and not dense_weights(*projections)):  # packed: one launch (GPU, CPU int4)
        fused = fused_linears(tuple(projections), x)
        if fused is not None:
            return list(fused)
    elif fuse_on_cpu and cpu_fusable(*projections):  # CPU: one row-wise product (dgpp.nn.batch_invariant)
        out = batch_invariant_fused_linear(x, tuple(p.weight for p in projections))
        return list(out.split([p.weight.shape[0] for p in projections], dim=-1))
    return [p(x) for p in projections]


def norm_and_rotate(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    q_norm: RMSNorm | None,
    k_norm: RMSNorm | None,
    rotary: RotaryEmbedding | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head q/k RMSNorm (when given), then rotary (when given). On CUDA the norms and a power-of-two
    rotation are one launch, the norms without a rotation one launch each."""
    if q_norm is None or k_norm is None:
        return (q, k) if rotary is None else rotary(positions, q, k)
    if rotary is None:
        return q_norm(q), k_norm(k)
    rot = rotary.rotary_dim
    if q.is_cuda and rot & (rot - 1) == 0:  # one launch for both norms and both rotations
        from dgpp import kernels

        offset, fp32_product = q_norm.kernel_numerics()
        return kernels.fused_qk_norm_rope(
            q,
            k,
            q_norm.weight,
            k_norm.weight,
            q_norm.eps,
            offset,
            positions,
            rotary.inv_freq,
            rotary.magnitude,
            is_neox=rotary.style == "half",
            fp32_product=fp32_product,
        )
    return rotary(positions, q_norm(q), k_norm(k))
