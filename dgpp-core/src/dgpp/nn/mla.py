"""Multi-head latent attention (MLA, DeepSeek-V2 style) over a paged latent cache.

q goes through a low-rank path (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) and splits per head into a
position-free part (``qk_nope_head_dim``) and a rotated part (``qk_rope_head_dim``). ``kv_a_proj_with_mqa``
gives ``[latent | k_rot]``: the latent is RMS-normed and cached as is, k_rot is rotated (one head shared by
all heads) and cached beside it (``LatentKV``). ``kv_b_proj`` expands a latent into per-head
``[k_nope | v]``. Under ``engine.kv_dtype`` fp8 / fp4 the latent is quantized as it is written (e4m3 codes or packed
fp4 rows with a row scale, ``dgpp.kernels.latent_formats``) and every reader dequantizes it to the compute dtype;
k_rot is stored as it is.

Two exact forms of the same attention:
- absorbed (the engine's path): ``kv_b``'s K half is folded into q (``q_lat = q_nope · W_uk``, scores
  against the cached latents directly) and its V half into the output (``out = (p · latent) · W_uvᵀ``),
  so a step reads ``latent + rope`` bytes per cached token and never expands K/V;
- expanded (the reference): K/V rebuilt from every cached latent, then ordinary attention.
They agree to rounding (tests/core/test_mla.py). On CUDA the absorbed form runs as Triton kernels
(``dgpp.nn.mla_cuda``); the CPU path is the torch one below. Every row is computed over exactly its visible (or
selected) keys with row-independent products, so a position's output does not depend on chunking,
batching or a prefix-cache hit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dgpp.family import World
from dgpp.kernels._triton import use_triton
from dgpp.kernels.latent_formats import dequantize_latent
from dgpp.nn.attention import context_token_rows, gather_rows, store_row_scaled
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.linear import Linear, UnquantizedLinearMethod
from dgpp.nn.norm import RMSNorm
from dgpp.nn.rotary import RotaryEmbedding, YarnScaling
from dgpp.nn.selection import DeviceSelection, Selection
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import CacheSpec, LatentKV


def mla_softmax_scale(qk_head_dim: int, yarn: YarnScaling | None = None) -> float:
    """``qk_head_dim^-½``, times ``mscale²`` under YaRN with ``mscale_all_dim`` (DeepSeek's rule: the
    rope's magnitude correction enters both q and k, hence squared)."""
    scale = qk_head_dim**-0.5
    if yarn is not None and yarn.mscale_all_dim and yarn.factor > 1:
        import math

        mscale = 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0
        scale *= mscale * mscale
    return scale


@dataclass
class MLAQuery:
    """This step's queries: ``q_resid`` (the normed low-rank q, which a DSA indexer also reads),
    ``q_nope`` ``[T, H, nope]`` and rotated ``q_rot`` ``[T, H, rope]``."""

    q_resid: torch.Tensor
    q_nope: torch.Tensor
    q_rot: torch.Tensor


class MultiLatentAttention(nn.Module):
    """MLA for one layer; parameter names follow DeepSeek/GLM checkpoints. Heads split over TP ranks
    (``q_b_proj``/``kv_b_proj`` column-, ``o_proj`` row-parallel; the caller all-reduces the output);
    the latent path is replicated. ``absorbed=False`` switches to the expanded reference form."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rotary: RotaryEmbedding,
        cache_name: str,
        *,
        dtype: torch.dtype,
        scale: float,
        norm_eps: float = 1e-6,
        bias: bool = False,
        world: World | None = None,
    ) -> None:
        super().__init__()
        world = world or World()
        if num_heads % world.size:
            raise ValueError(f"{num_heads} heads do not split over TP world {world.size}")
        if rotary.rotary_dim != qk_rope_head_dim:
            raise ValueError(f"rotary dim {rotary.rotary_dim} must equal qk_rope_head_dim {qk_rope_head_dim}")
        self.num_heads = num_heads // world.size
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.cache_name = cache_name
        self.scale = scale
        self.dtype = dtype
        self.absorbed = True
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias, dtype=dtype, world=world)
        self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps, dtype=dtype)
        self.q_b_proj = Linear(q_lora_rank, num_heads * qk_dim, dtype=dtype, parallel="column", world=world)
        self.kv_a_proj_with_mqa = Linear(
            hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias, dtype=dtype, world=world
        )
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps, dtype=dtype)
        self.kv_b_proj = Linear(
            kv_lora_rank,
            num_heads * (qk_nope_head_dim + v_head_dim),
            dtype=dtype,
            parallel="column",
            world=world,
        )
        self.o_proj = Linear(
            num_heads * v_head_dim, hidden_size, bias=bias, dtype=dtype, parallel="row", world=world
        )
        self.rotary = rotary

    def cache_spec(self) -> LatentKV:
        return LatentKV.of(self.kv_lora_rank, self.rope_dim, self.dtype)

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """This layer's latent entry, in the layer's own dtype (the model's ``cache_spec`` collects it)."""
        return {self.cache_name: self.cache_spec()}

    def prepare(self, x: torch.Tensor, batch: ForwardBatch) -> MLAQuery:
        """Project this step's rows: store their normed latents and rotated k_rot in the cache, return the queries."""
        rows = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(rows, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rot = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot, k_rot = self.rotary(batch.positions, q_rot.contiguous(), k_rot.reshape(rows, 1, self.rope_dim))
        # engine.kv_dtype fp8 / fp4: the latent is quantized on its way in, k_rot is not
        store_row_scaled(batch, self.cache_name, latent.reshape(rows, 1, -1), k_rot)
        return MLAQuery(q_resid, q_nope, q_rot)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Dense causal MLA (no token selection)."""
        return self.attend(self.prepare(x, batch), batch)

    def attend(
        self, query: MLAQuery, batch: ForwardBatch, selection: Selection | DeviceSelection | None = None
    ) -> torch.Tensor:
        """Attention of this step's rows over the cache (each over ``selection[row]`` when given), ``o_proj``'d."""
        if self.absorbed and use_triton(query.q_nope):
            from dgpp.nn.mla_cuda import absorbed_attention_cuda

            kv_b = self.kv_b_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
            latent_cache, rope_cache = batch.cache.kv[self.cache_name]
            scales = batch.cache.kv_scales.get(self.cache_name)
            out = absorbed_attention_cuda(
                query.q_nope,
                query.q_rot,
                kv_b,
                latent_cache,
                rope_cache,
                batch,
                selection,
                self.scale,
                latent_scale=None if scales is None else scales[0],
            )
            return self.o_proj(out.flatten(1))
        if query.q_nope.is_cuda and torch.cuda.is_current_stream_capturing():
            # the torch path loops over host-side lengths: a captured graph would replay the capture's lengths
            raise RuntimeError("MLA's torch path cannot be captured in a CUDA graph (DGPP_KERNELS=torch)")
        if isinstance(selection, DeviceSelection):  # the CUDA indexer's picks, on the reference path
            selection = selection.as_rows()
        kv_b = self.kv_b_weight().view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        core = self._absorbed if self.absorbed else self._expanded
        out = query.q_nope.new_zeros(query.q_nope.shape[0], self.num_heads, self.v_dim)
        latent_cache, rope_cache = batch.cache.kv[self.cache_name]
        scales = batch.cache.kv_scales.get(self.cache_name)
        start = 0
        for i, q_len in enumerate(batch.q_lens_cpu):
            length = batch.seq_lens_cpu[i]
            if q_len and length:  # seq_len 0: a padding row, zeros
                rows = slice(start, start + q_len)
                token_rows = context_token_rows(batch.block_tables[i], length, latent_cache.shape[1])
                latent = gather_rows(latent_cache, token_rows)[:, 0]
                if scales is not None:  # a quantized latent, read as every reader reads it
                    row_scale = gather_rows(scales[0], token_rows)[:, 0]
                    latent = dequantize_latent(latent, row_scale, self.kv_lora_rank, self.dtype)
                k_rot = gather_rows(rope_cache, token_rows)[:, 0]
                picks = None if selection is None else selection[start : start + q_len]
                out[rows] = core(
                    query.q_nope[rows],
                    query.q_rot[rows],
                    latent,
                    k_rot,
                    kv_b,
                    batch.context_lens_cpu[i],
                    picks,
                )
            start += q_len
        return self.o_proj(out.flatten(1))

    def kv_b_weight(self) -> torch.Tensor:
        """``kv_b_proj``'s [out_local, kv_lora_rank] matrix in the compute dtype (``settle_weights`` decodes a packed
        one once at load; a module that skipped it decodes here, every call)."""
        layer = self.kv_b_proj
        weight = getattr(layer, "weight", None)
        if weight is not None:
            return weight
        return layer.quant_method.dense_weight(layer, self.dtype)

    def settle_weights(self) -> None:
        """Keep a packed ``kv_b_proj`` (int8 in the GLM-5.3 release) as its decoded matrix: absorption reads the
        whole matrix in every step (it is never multiplied as a linear), and decoding it per step cost about a third
        of a GLM-5.3 decode step (docs/benchmarks.md). The matrix is the same bits the per-step decode gave, at
        twice the int8 bytes (29 MB a layer at the release's size, whole; TP splits it by heads). On ``meta``
        (memory plans) only the shape and dtype change."""
        layer = self.kv_b_proj
        if getattr(layer, "weight", None) is not None:
            return
        names = layer.quant_method.tensors(layer)
        if any(t.is_meta for t in names.values()):
            dense = torch.empty(layer.out_local, layer.in_local, dtype=self.dtype, device="meta")
        else:
            dense = layer.quant_method.dense_weight(layer, self.dtype)
        for name in names:
            delattr(layer, name)
        del layer.quant_tensor_names
        layer.quant_method = UnquantizedLinearMethod()
        layer.weight = nn.Parameter(dense, requires_grad=False)

    def _keys(self, row: int, q_offset: int, picks: Selection | None) -> torch.Tensor | slice:
        chosen = None if picks is None else picks[row]
        return slice(0, q_offset + row + 1) if chosen is None else chosen

    def _absorbed(self, q_nope, q_rot, latent, k_rot, kv_b, q_offset, picks) -> torch.Tensor:
        """Scores against the latents through ``q_lat = q_nope · W_uk``; output ``(p · latent) · W_uvᵀ``."""
        w_uk, w_uv = kv_b.split((self.nope_dim, self.v_dim), dim=1)  # [H, nope, L], [H, v, L]
        q_lat = torch.stack(
            [batch_invariant_linear(q_nope[:, h], w_uk[h].t()) for h in range(self.num_heads)], 1
        )
        latent, k_rot = latent.to(q_lat.dtype), k_rot.to(q_lat.dtype)
        o_lat = q_lat.new_empty(q_lat.shape)
        for r in range(q_lat.shape[0]):
            keys = self._keys(r, q_offset, picks)
            lat, rope = latent[keys], k_rot[keys]
            scores = batch_invariant_linear(q_lat[r], lat)
            if self.rope_dim:  # NoPE MLA (GLM-5.3-Flash) has no rotated part
                scores = scores + batch_invariant_linear(q_rot[r], rope)
            probs = torch.softmax(scores * self.scale, dim=-1, dtype=torch.float32).to(q_lat.dtype)
            o_lat[r] = batch_invariant_linear(probs, lat.t())
        return torch.stack([batch_invariant_linear(o_lat[:, h], w_uv[h]) for h in range(self.num_heads)], 1)

    def _expanded(self, q_nope, q_rot, latent, k_rot, kv_b, q_offset, picks) -> torch.Tensor:
        """Reference: per-head K = ``[kv_b(latent)_nope | k_rot]``, V = ``kv_b(latent)_v``, plain attention."""
        length = latent.shape[0]
        kv = batch_invariant_linear(latent.to(q_nope.dtype), kv_b.reshape(-1, self.kv_lora_rank))
        k_nope, v = kv.view(length, self.num_heads, -1).split((self.nope_dim, self.v_dim), dim=-1)
        k = torch.cat((k_nope, k_rot.to(k_nope.dtype)[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rot), dim=-1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        for r in range(q.shape[0]):
            keys = self._keys(r, q_offset, picks)
            for h in range(self.num_heads):
                scores = batch_invariant_linear(q[r, h], k[keys, h]) * self.scale
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
                out[r, h] = batch_invariant_linear(probs, v[keys, h].t())
        return out
