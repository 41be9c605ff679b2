"""Attention cores with per-head sink logits: full attention over the paged pool, or sliding-window attention
over a window-bounded ring (``dgpp.step.cache_spec.WindowKV``).

A sink is one learned logit per query head that joins each row's softmax and attends to nothing (gpt-oss,
Flint, MiMo, DeepSeek-V4): it takes probability mass away from the keys without adding a value. The
window follows transformers' convention: ``window = W`` lets a row at position ``p`` see ``p - W + 1 .. p``.

The sliding layer's cache is a ring of ``W - 1`` positions per request in the state pool, not pool blocks:
its memory is fixed per request whatever the context, a prefix-cache hit restores it from the request's
state snapshot like any recurrent state, and the full-attention layers keep the shared paged pool. The step
reads the ring before it writes it, so a prefill chunk of any length attends correctly (its early rows need
ring entries its later rows replace). The sliding path runs ``dgpp.kernels.window_attention``: one Triton program
per (row, KV head) on CUDA (no host sync: decode steps capture in CUDA graphs), the torch reference elsewhere.
The full path runs ``dgpp.nn.paged_sink_attention``: its decode rows cut their context into partitions computed
by programs of their own (split-context decoding), its prefill rows take the window kernel.
Under ``engine.kv_dtype: fp8`` the pool entry and the ring hold e4m3 rows with per-row scales: a sliding step
rounds its own K/V through e4m3 before attending, so each key reads the same whether it comes from the step or,
later, from the ring.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.kernels.kv_fp8 import dequantize_rows, quantize_rows
from dgpp.nn.attention import store_kv
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import PagedKV, WindowKV


class SinkAttention(nn.Module):
    """Attention core of one layer: ``q [T, Hq, D]``, ``k [T, Hk, D]``, ``v [T, Hk, Dv]`` (after any norm and
    RoPE) and the per-head ``sinks [Hq]`` (or None) -> ``[T, Hq*Dv]``. ``window=None``: full causal attention,
    K/V in the paged pool entry ``cache_name``; ``window=W``: sliding, K/V in the ring state entry
    ``cache_name``. ``v_head_dim`` (default ``head_dim``): MiMo's values are narrower than its keys."""

    def __init__(
        self,
        cache_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        scale: float | None = None,
        v_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if window is not None and window < 2:
            raise ValueError(f"a sliding window must cover at least 2 tokens, got {window}")
        self.cache_name = cache_name
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim
        self.window = window
        self.scale = head_dim**-0.5 if scale is None else scale

    def cache_spec(self, dtype: torch.dtype) -> PagedKV | WindowKV:
        if self.window is None:
            return PagedKV(self.num_kv_heads, self.head_dim, dtype, v_head_dim=self.v_head_dim, fp8_rows=True)
        return WindowKV(
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            window=self.window,
            v_head_dim=self.v_head_dim,
            fp8_rows=True,
        )

    def cache_entries(self, dtype: torch.dtype) -> dict[str, PagedKV | WindowKV]:
        """This layer's entry: paged K/V, or its ring (the model's ``cache_spec`` collects it)."""
        return {self.cache_name: self.cache_spec(dtype)}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        common = (batch.query_start_loc, batch.context_lens, batch.seq_lens, sinks, self.scale)
        if self.window is None:
            from dgpp.nn.paged_sink_attention import paged_sink_attention

            k_cache, v_cache = batch.cache.kv[self.cache_name]
            scales = store_kv(batch, self.cache_name, k, v)
            row_seq = step_row_sequences(batch, q.shape[0])
            out = paged_sink_attention(q, k_cache, v_cache, batch, sinks, self.scale, scales, row_seq)
        else:
            out = sliding_step(q, k, v, batch.cache.state[self.cache_name], batch, common, self.window)
        return out.flatten(1)


def sliding_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: dict[str, torch.Tensor],
    batch: ForwardBatch,
    common: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float],
    window: int,
) -> torch.Tensor:
    """Attend over the ring and this step's rows, then store the step's last rows in the ring. An e4m3 ring
    (``k_scale``/``v_scale`` beside its codes) gets the step's rows quantized; the attention reads them
    dequantized, as a later step reads them back from the ring."""
    from dgpp.kernels.ring_write import RingWriteInputs, ring_write
    from dgpp.kernels.window_attention import window_attention

    places = (batch.state_slots, batch.query_start_loc, batch.context_lens, batch.seq_lens)
    row_seq = step_row_sequences(batch, q.shape[0])
    scales = (ring["k_scale"], ring["v_scale"]) if "k_scale" in ring else None
    if scales is None:
        out = window_attention(
            q, k, v, ring["k"], ring["v"], batch.state_slots, *common, window, False, row_seq=row_seq
        )
        # after the read: this step's later rows may take ring entries its earlier rows needed
        ring_write(RingWriteInputs(k, v, ring["k"], ring["v"], *places, row_seq))
        return out
    (k_codes, k_scale), (v_codes, v_scale) = quantize_rows(k), quantize_rows(v)
    k_seen, v_seen = dequantize_rows(k_codes, k_scale, k.dtype), dequantize_rows(v_codes, v_scale, v.dtype)
    out = window_attention(
        q, k_seen, v_seen, ring["k"], ring["v"], batch.state_slots, *common, window, False, scales, row_seq
    )
    ring_write(RingWriteInputs(k_codes, v_codes, ring["k"], ring["v"], *places, row_seq))
    ring_write(RingWriteInputs(k_scale, v_scale, scales[0], scales[1], *places, row_seq))
    return out


def step_row_sequences(batch: ForwardBatch, rows: int) -> torch.Tensor | None:
    """The sequence of each of the step's ``rows`` rows on CUDA, computed once a step for every window
    layer; None elsewhere (the torch references walk the sequences on the host)."""
    if not batch.query_start_loc.is_cuda:
        return None
    from dgpp.kernels.window_attention import row_sequences

    return batch.step_memo(("row_sequences", rows), lambda: row_sequences(batch.query_start_loc, rows))
