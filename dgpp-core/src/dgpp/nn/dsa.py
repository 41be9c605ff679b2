"""DeepSeek sparse attention (DSA) indexer: which cached tokens each query row attends to.

Per token the indexer caches one key ``LayerNorm(wk(x))`` with RoPE on its first ``rotary_dim`` dims
(a paged entry with no V; under ``engine.kv_dtype`` fp8 or fp4 an e4m3 row with one fp32 scale, the original
engine's index-cache form, dequantized to the compute dtype when read). A query row at position ``p`` scores
every visible token ``t <= p``: ``Σ_h w_h · relu(q_h · k_t · D^-½)`` with its own queries ``q = wq_b(q_resid)``
(RoPE likewise on the first dims) and per-head weights ``w = weights_proj(x) · H^-½`` (fp32, as the reference
keeps that projection). The row keeps the ``topk`` best tokens, exact ties going to the lower position, in
ascending order; with ``p + 1 <= topk`` visible tokens it keeps them all (dense, ``None``).

Layers that do not run an indexer reuse the previous indexer layer's selection (GLM-5's cross-layer
sharing); that wiring is the model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.compressed_attention import per_row_bmm
from dgpp.nn.attention import context_token_rows, read_rows, store_keys
from dgpp.nn.batch_invariant import batch_invariant_rows
from dgpp.nn.linear import Linear
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.nn.selection import DeviceSelection, Selection
from dgpp.nn.weights import default_weight_loader, set_weight_attrs
from dgpp.step.batch import ForwardBatch
from dgpp.step.cache_spec import PagedKV


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` (weight and bias) with rows independent of how many share the call."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        for p in (self.weight, self.bias):
            set_weight_attrs(p, weight_loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = lambda rows: F.layer_norm(rows, (rows.shape[-1],), self.weight, self.bias, self.eps)  # noqa: E731
        return batch_invariant_rows(norm, x)


def top_k_lowest_on_ties(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` highest ``scores`` (exact ties: the lower position wins), ascending."""
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return order.sort().values


# keys per product: a CPU product's column bits depend on how many columns it makes (the kernel's vector blocks
# and remainder loops), so every key is scored in a product of this many keys, at the same column of it
SCORE_TILE = 128


def index_scores_rows(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``Σ_h w_h · relu(q_h · k_t · D^-½)`` of each row ``r`` (``q [R, H, D]``, ``weights [R, H]``) over its own keys
    (``keys [R, n, D]``) -> ``[R, n]``, fp32 in and out.

    A score's bits depend on its row's query and weights and on its key alone, not on how many rows or keys share
    the call, so a decode step (every row of the batch over every entry its table could hold), a verify or prefill
    row (the entries it sees) and the per-row reference score alike: keys go ``SCORE_TILE`` at a time (the last
    tile padded with zeros), each tile through per-row products (``per_row_bmm``), the heads summed by one more."""
    rows, n = keys.shape[0], keys.shape[1]
    scale = q.shape[-1] ** -0.5
    scores = []
    for first in range(0, n, SCORE_TILE):
        tile = keys[:, first : first + SCORE_TILE]
        if tile.shape[1] < SCORE_TILE:
            tile = F.pad(tile, (0, 0, 0, SCORE_TILE - tile.shape[1]))
        per_head = F.relu(per_row_bmm(q, tile.transpose(1, 2)) * scale)  # [R, H, SCORE_TILE]
        scores.append(per_row_bmm(weights[:, None, :], per_head)[:, 0])
    return torch.cat(scores, 1)[:, :n] if scores else keys.new_empty(rows, 0)


def index_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``index_scores_rows`` of one row: ``q [H, D]``, ``keys [n, D]``, ``weights [H]`` -> ``[n]``."""
    return index_scores_rows(q[None], keys[None], weights[None])[0]


class DSAIndexer(nn.Module):
    """The indexer of one layer (``indexer.*`` in GLM-5 / DeepSeek-V3.2 checkpoints), replicated over TP."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        topk: int,
        rotary: RotaryEmbedding,
        cache_name: str,
        *,
        dtype: torch.dtype,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.topk = num_heads, head_dim, topk
        self.cache_name = cache_name
        self.dtype = dtype
        self.wq_b = Linear(q_lora_rank, num_heads * head_dim, dtype=dtype)
        self.wk = Linear(hidden_size, head_dim, dtype=dtype)
        self.k_norm = LayerNorm(head_dim, norm_eps, dtype=dtype)
        self.weights_proj = Linear(
            hidden_size, num_heads, dtype=torch.float32
        )  # fp32, as the reference keeps it
        self.rotary = rotary

    def cache_spec(self) -> PagedKV:
        """One key per token, no V; e4m3 rows with a row scale under a quantized ``engine.kv_dtype``."""
        return PagedKV(
            num_kv_heads=1,
            head_dim=self.head_dim,
            dtype=self.dtype,
            v_head_dim=0,
            fp8_rows=True,
            index_keys=True,
        )

    def forward(
        self, x: torch.Tensor, q_resid: torch.Tensor, batch: ForwardBatch
    ) -> Selection | DeviceSelection | None:
        """Store this step's indexer keys, then select per row (``None``: dense). On CUDA the selection is a
        ``DeviceSelection`` (``dgpp.nn.dsa_cuda``); the torch path below is the CPU's and the reference."""
        rows = x.shape[0]
        q = self.wq_b(q_resid).view(rows, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(rows, 1, self.head_dim)
        q, k = self.rotary(batch.positions, q, k)
        k_cache = batch.cache.kv[self.cache_name][0]
        k_scale = store_keys(batch, self.cache_name, k)
        weights = self.weights_proj(x.float()) * self.num_heads**-0.5
        if use_triton(x):
            from dgpp.nn.dsa_cuda import device_selection

            return device_selection(q, weights, k_cache, batch, self.topk, self.head_dim**-0.5, k_scale)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            # which rows select, and over how many keys, is read from host-side lengths: a graph would replay
            # the capture's
            raise RuntimeError(
                "the DSA indexer's torch path cannot be captured in a CUDA graph (DGPP_KERNELS=torch)"
            )
        selection: Selection = [None] * rows
        start = 0
        for i, q_len in enumerate(batch.q_lens_cpu):
            offset, length = batch.context_lens_cpu[i], batch.seq_lens_cpu[i]
            if length > self.topk and q_len:
                token_rows = context_token_rows(batch.block_tables[i], length, k_cache.shape[1])
                keys = read_rows(k_cache, k_scale, token_rows, self.dtype)[:, 0].float()
                for r in range(max(0, self.topk - offset), q_len):  # rows with more than topk visible tokens
                    visible = offset + r + 1
                    scores = self.scores(q[start + r].float(), keys[:visible], weights[start + r])
                    selection[start + r] = top_k_lowest_on_ties(scores, self.topk)
            start += q_len
        return selection

    def scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return index_scores(q, keys, weights)
