"""The toy model: token + learned position embeddings, N pre-norm blocks (multi-head attention over the
engine's paged KV cache, a ReLU MLP), a final norm and an untied head.

It implements dgpp's model contract (``dgpp.engine.model.Model``) with plain torch: the engine owns the
KV memory, this model writes its new K/V rows through ``batch.slot_mapping`` and reads each sequence's
history through its row of ``batch.block_tables``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dgpp.engine.batch import ForwardBatch
from dgpp.engine.cache_spec import CacheSpec, PagedKV
from dgpp.engine.model import Model, ModelInfo


@dataclass(frozen=True)
class ToyConfig:
    """The toy architecture's config.json keys (``model_type: dgpp_toy``)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    eos_token_id: int | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ToyBlock(nn.Module):
    def __init__(self, cfg: ToyConfig, name: str) -> None:
        super().__init__()
        self.cfg, self.cache_name = cfg, name
        h, qkv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, 3 * qkv, bias=False)
        self.o = nn.Linear(qkv, h, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def attention(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        heads, dim = self.cfg.num_attention_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).view(-1, 3, heads, dim).unbind(1)
        k_cache, v_cache = batch.cache.kv[self.cache_name]
        block_size = k_cache.shape[1]
        flat_k, flat_v = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
        keep = batch.slot_mapping >= 0  # padding rows (slot -1) write nothing
        flat_k[batch.slot_mapping[keep]] = k[keep].to(flat_k.dtype)
        flat_v[batch.slot_mapping[keep]] = v[keep].to(flat_v.dtype)
        out = torch.empty_like(q)
        starts = batch.query_start_loc.tolist()
        for i, (ctx, total) in enumerate(zip(batch.context_lens_cpu, batch.seq_lens_cpu, strict=True)):
            pos = torch.arange(total, device=x.device)
            slots = batch.block_tables[i, pos // block_size].long() * block_size + pos % block_size
            keys, values = flat_k[slots].to(q.dtype), flat_v[slots].to(q.dtype)  # [total, heads, dim]
            rows = q[starts[i] : starts[i + 1]]  # positions ctx .. total-1
            scores = torch.einsum("qhd,khd->hqk", rows, keys) / dim**0.5
            causal = pos[None, :] <= (ctx + torch.arange(rows.shape[0], device=x.device))[:, None]
            scores = scores.masked_fill(~causal, float("-inf"))
            out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return self.o(out.reshape(x.shape[0], heads * dim))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.attention(rms_norm(x, self.attn_norm, self.cfg.rms_norm_eps), batch)
        return x + self.down(torch.relu(self.up(rms_norm(x, self.mlp_norm, self.cfg.rms_norm_eps))))


class ToyModel(Model):
    """``ToyForCausalLM``: what a family's model class looks like to the engine."""

    def __init__(self, cfg: ToyConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(ToyBlock(cfg, f"layers.{i}.attn") for i in range(cfg.num_hidden_layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        eos = () if cfg.eos_token_id is None else (cfg.eos_token_id,)
        self.info = ModelInfo(
            vocab_size=cfg.vocab_size,
            max_position=cfg.max_position_embeddings,
            eos_token_ids=eos,
            dtype=dtype,
        )
        self.to(dtype)

    def cache_spec(self) -> dict[str, CacheSpec]:
        return {
            block.cache_name: PagedKV(self.cfg.num_attention_heads, self.cfg.head_dim, self.info.dtype)
            for block in self.layers
        }

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.embed(batch.input_ids) + self.pos_embed(batch.positions)
        for block in self.layers:
            x = block(x, batch)
        return rms_norm(x[batch.logits_indices], self.final_norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits of every position of one sequence with no cache at all (what tests compare against)."""
        ids = torch.tensor(token_ids)
        x = self.embed(ids) + self.pos_embed(torch.arange(len(token_ids)))
        heads, dim, n = self.cfg.num_attention_heads, self.cfg.head_dim, len(token_ids)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        for block in self.layers:
            q, k, v = (
                block.qkv(rms_norm(x, block.attn_norm, self.cfg.rms_norm_eps))
                .view(n, 3, heads, dim)
                .unbind(1)
            )
            scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5
            attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
            x = x + block.o(attn.reshape(n, heads * dim))
            x = x + block.down(torch.relu(block.up(rms_norm(x, block.mlp_norm, self.cfg.rms_norm_eps))))
        return self.compute_logits(rms_norm(x, self.final_norm, self.cfg.rms_norm_eps))
