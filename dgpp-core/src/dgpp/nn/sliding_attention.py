"""Attention cores with per-head sink logits: full attention over the paged pool, or sliding-window attention
over a window-bounded ring (``dgpp.step.cache_spec.WindowKV``).

A sink is one learned logit per query head that joins each row's softmax and attends to nothing (gpt-oss,
Flint, MiMo, DeepSeek-V4): it takes probability mass away from the keys without adding a value. The
window follows transformers' convention: ``window = W`` lets a row at position ``p`` see ``p - W + 1 .. p``.

The sliding layer's cache is a ring of ``W - 1`` positions per request in the state pool, not pool blocks:
its memory is fixed per request whatever the context, a prefix-cache hit restores it from the request's
state snapshot like any recurrent state, and the full-attention layers keep the shared paged pool. The step
reads the ring before it writes it, so a prefill chunk of any length attends correctly (its early rows need
ring entries its later rows replace). Both paths run ``dgpp.kernels.window_attention``: one Triton program per
(row, KV head) on CUDA (no host sync: decode steps capture in CUDA graphs), the torch reference elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.nn.attention import write_kv
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
            return PagedKV(self.num_kv_heads, self.head_dim, dtype, v_head_dim=self.v_head_dim)
        return WindowKV(
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            window=self.window,
            v_head_dim=self.v_head_dim,
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
        from dgpp import kernels
        from dgpp.kernels.window_attention import ring_write, window_attention

        common = (batch.query_start_loc, batch.context_lens, batch.seq_lens, sinks, self.scale)
        if self.window is None:
            k_cache, v_cache = batch.cache.kv[self.cache_name]
            (kernels.write_kv if q.is_cuda else write_kv)(k_cache, v_cache, k, v, batch.slot_mapping)
            out = window_attention(q, None, None, k_cache, v_cache, batch.block_tables, *common, 0, True)
        else:
            ring = batch.cache.state[self.cache_name]
            out = window_attention(
                q, k, v, ring["k"], ring["v"], batch.state_slots, *common, self.window, False
            )
            # after the read: this step's later rows may take ring entries its earlier rows needed
            ring_write(
                k,
                v,
                ring["k"],
                ring["v"],
                batch.state_slots,
                batch.query_start_loc,
                batch.context_lens,
                batch.seq_lens,
            )
        return out.flatten(1)
