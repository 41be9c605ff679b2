"""GLM-5.3-Flash's k-pooled DSA indexer: which cached tokens each MLA query row attends to.

Per token the indexer makes a key ``k = LayerNorm(wk(x))`` and gate logits ``x · index_kpool_compress_gateᵀ``
(both ``[index_head_dim]``). Every ``kpool`` consecutive tokens (pools start at the sequence's first token) form a
pool whose key is ``Σ_t softmax_t(gate_t + index_kpool_compress_ape[t]) ⊙ k_t`` per channel. Pooled keys are cache
entries (``CompressedKV``, written once, in the step that completes the pool); the open pool's rows wait in a
per-request ring (``dgpp.nn.window_compressor``), so chunked prefill, batching and prefix-cache hits pool the same
rows in the same order.

A row at position ``p`` sees ``n = (p + 1) // kpool`` complete pools. With ``n <= index_topk // kpool`` it attends
every visible token (dense); else it scores each complete pool ``Σ_h w_h · relu(q_h · key · D^-½)`` (``q = wq_b(q_resid)``,
``w = weights_proj(x) · H^-½``), keeps the ``index_topk // kpool`` best (exact ties to the lower pool), expands them
to their tokens and appends the visible tokens of the open pool (the tail, at most ``kpool - 1``).

A decode-only step (one row per sequence) runs ``dgpp_glm.glm5_next_indexer_decode`` instead of the row loop: the
same pools, scores and picks from device-side lengths alone, so eager and captured decode run one code path.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.dsa import LayerNorm, index_scores, top_k_lowest_on_ties
from dgpp.nn.linear import Linear
from dgpp.nn.selection import DeviceSelection, Selection
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.nn.window_compressor import WindowPooler, gather_entries, live_sequences
from dgpp.plugin_api import CacheSpec, CompressedKV, ForwardBatch
from dgpp_glm.glm5_next_indexer_decode import pooled_scores_fused, select_decode, store_decode


class KPoolIndexer(WindowPooler):
    """``self_attn.indexer.*`` of one layer (replicated over TP): ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``,
    ``index_kpool_compress_gate`` ``[D, hidden]`` and ``index_kpool_compress_ape`` ``[kpool, D]``.
    ``select_tail``: append the open pool's visible tokens to a sparse row's picks (the release always does)."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        topk: int,
        kpool: int,
        cache_name: str,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(head_dim, kpool, cache_name, overlap=False, dtype=dtype)
        self.num_heads, self.kpool = num_heads, kpool
        self.select_pools = topk // kpool
        self.select_tail = True
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, dtype=dtype)
        self.wk = Linear(hidden_size, head_dim, dtype=dtype)
        self.k_norm = LayerNorm(head_dim, 1e-6, dtype=dtype)
        self.weights_proj = Linear(hidden_size, num_heads, dtype=dtype)
        self.index_kpool_compress_gate = nn.Parameter(
            torch.empty(head_dim, hidden_size, dtype=dtype), requires_grad=False
        )
        self.index_kpool_compress_ape = nn.Parameter(
            torch.empty(kpool, head_dim, dtype=dtype), requires_grad=False
        )
        for p in (self.index_kpool_compress_gate, self.index_kpool_compress_ape):
            set_weight_attrs(p, weight_loader=default_weight_loader)

    def cache_spec(self) -> dict[str, CacheSpec]:
        """The pooled keys (e4m3 rows with a row scale under a quantized ``engine.kv_dtype``, the original
        engine's index-cache form) and the open-pool ring (kept in the compute dtype)."""
        spec = super().cache_spec()
        keys = spec[self.cache_name]
        assert isinstance(keys, CompressedKV)
        spec[self.cache_name] = replace(keys, fp8_rows=True, index_keys=True)
        return spec

    def position_bias(self) -> torch.Tensor:
        return self.index_kpool_compress_ape

    def pool_windows(self, kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Pooled keys of complete pools ``kv`` / ``gate`` ``[B, kpool, D]`` -> ``[B, D]``: the batched ``pool`` the
        prefill's ``store`` runs (the softmax over each pool's rows per channel, in fp32, weights rounded to the
        keys' dtype), so a decode step pools with the same bits."""
        return self.pool(kv, gate, torch.zeros(kv.shape[0], dtype=torch.long, device=kv.device))

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch
    ) -> Selection | DeviceSelection | None:
        """Pool the keys this step completes, then select per row (``None``: every visible token)."""
        # row-independent products: a row's gate logits and scores do not depend on what shares the step
        gate = batch_invariant_linear(x, self.index_kpool_compress_gate)
        rows = x.shape[0]
        q = self.wq_b(q_resid).view(rows, self.num_heads, self.head_dim).float()
        weights = self.weights_proj(x).float() * self.num_heads**-0.5
        if batch.is_decode_only:
            store_decode(self, self.k_norm(self.wk(x)), gate, batch)
            return select_decode(self, q, weights, batch)
        self.store(self.k_norm(self.wk(x)), gate, batch)
        return self.select_rows(q, weights, batch)

    def select_rows(self, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch) -> Selection:
        """Row by row from host-side lengths, over the pools already stored (``None``: every visible token)."""
        rows = q.shape[0]
        pool = batch.cache.kv[self.cache_name][0]
        scales = batch.cache.kv_scales.get(self.cache_name)
        selection: Selection = [None] * rows
        fused = self.row_scores_fused(q, weights, batch) if use_triton(q) else None
        for b, start, q_len, ctx, end, _ in live_sequences(batch):
            count = end // self.kpool  # complete pools after this step
            if count <= self.select_pools:
                continue  # no row of this sequence sees more pools than it keeps: all dense
            keys = (
                None
                if fused is not None
                else gather_entries(
                    pool,
                    batch.block_tables[b],
                    count,
                    self.kpool,
                    batch.cache.block_size,
                    None if scales is None else scales[0],
                    self.dtype,
                ).float()
            )
            for i in range(q_len):
                row, visible = start + i, ctx + i + 1
                complete = visible // self.kpool
                if complete > self.select_pools:
                    if keys is None:
                        assert fused is not None
                        scores = fused[row, :complete]
                    else:
                        scores = index_scores(q[row], keys[:complete], weights[row])
                    selection[row] = self.expand(top_k_lowest_on_ties(scores, self.select_pools), visible)
        return selection

    def row_scores_fused(self, q: torch.Tensor, weights: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Every row's pool scores on CUDA through the kernel a decode step scores with, so both select from the
        same bits (rows of padding sequences score nothing)."""
        seq_of_row, complete = [0] * q.shape[0], [0] * q.shape[0]
        for b, start, q_len, ctx, _, _ in live_sequences(batch):
            for i in range(q_len):
                seq_of_row[start + i], complete[start + i] = b, (ctx + i + 1) // self.kpool
        tables = batch.block_tables[torch.tensor(seq_of_row, dtype=torch.long, device=q.device)]
        lens = torch.tensor(complete, dtype=torch.int32, device=q.device)
        return pooled_scores_fused(self, q, weights, batch, tables, lens)

    def expand(self, pools: torch.Tensor, visible: int) -> torch.Tensor:
        """The token positions of ascending ``pools``, then (``select_tail``) the open pool's visible tokens."""
        tokens = (pools[:, None] * self.kpool + torch.arange(self.kpool, device=pools.device)).flatten()
        if not self.select_tail:
            return tokens
        tail = torch.arange(visible - visible % self.kpool, visible, device=pools.device)
        return torch.cat([tokens, tail])
