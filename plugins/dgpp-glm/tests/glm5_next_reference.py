"""A float64 reference for GLM-5.3-Flash's MTP layer, written from the release layout and the spec (the original
engine, github.com/HawkBearPig/dgpp ``src/models/glm``), independent of transformers (which drops the layer) and of
dgpp's layers: one sequence, every row at once, no cache.

Row ``q`` (position ``q``): ``x = eh_proj([enorm(embed(token q + 1)) | hnorm(h_q)])`` with ``h_q`` the main model's
streams' mean before its final norm; ``x += MLA(input_layernorm(x))`` over the tokens the k-pooled indexer keeps;
``x += MoE(post_attention_layernorm(x))``; logits ``lm_head(shared_head.norm(x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from glm_reference import linear, rms_norm, route

from dgpp_glm.glm5_next_config import Glm5NextArchConfig


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def clamped_swiglu(w: dict, pre: str, x: torch.Tensor, limit: float | None) -> torch.Tensor:
    """SwiGLU with the release's asymmetric clamps: gate ``<= limit``, up within ``±limit``."""
    gate, up = linear(w, pre + "gate_proj", x), linear(w, pre + "up_proj", x)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return linear(w, pre + "down_proj", F.silu(gate) * up)


def moe(w: dict, pre: str, x: torch.Tensor, cfg: Glm5NextArchConfig) -> torch.Tensor:
    ids, weights = route(w, pre, x, cfg)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = f"{pre}experts.{int(ids[row, slot])}."
            out[row] += weights[row, slot] * clamped_swiglu(w, expert, x[row : row + 1], cfg.swiglu_limit)[0]
    return out + clamped_swiglu(w, pre + "shared_experts.", x, cfg.swiglu_limit)


def pooled_keys(w: dict, pre: str, x: torch.Tensor, kpool: int) -> torch.Tensor:
    """One key per complete pool of ``kpool`` tokens (pools start at token 0): per channel, the softmax over the
    pool's tokens of ``gate + ape`` weighting the tokens' ``LayerNorm(wk(x))`` keys."""
    k = layer_norm(linear(w, pre + "wk", x), w[pre + "k_norm.weight"], w[pre + "k_norm.bias"], 1e-6)
    gate = x @ w[pre + "index_kpool_compress_gate"].T
    pools = x.shape[0] // kpool
    logits = gate[: pools * kpool].view(pools, kpool, -1) + w[pre + "index_kpool_compress_ape"]
    return (logits.softmax(dim=1) * k[: pools * kpool].view(pools, kpool, -1)).sum(dim=1)


def index_mask(
    w: dict, pre: str, x: torch.Tensor, q_resid: torch.Tensor, cfg: Glm5NextArchConfig
) -> torch.Tensor:
    """``[T, T]``: which tokens each row attends. A row at ``p`` sees ``n = (p + 1) // kpool`` complete pools; with
    ``n <= index_topk // kpool`` every token up to ``p``, else the best pools by ``Σ_h w_h relu(q_h · key / √D)``
    (``w = weights_proj(x) / √H``; exact ties to the lower pool) plus the open pool's tokens up to ``p``."""
    t, kpool, heads, dim = x.shape[0], cfg.index_kpool, cfg.index_n_heads, cfg.index_head_dim
    keys = pooled_keys(w, pre, x, kpool)
    q = linear(w, pre + "wq_b", q_resid).view(t, heads, dim)
    head_weights = linear(w, pre + "weights_proj", x) * heads**-0.5
    select = cfg.index_topk // kpool
    mask = torch.zeros(t, t, dtype=torch.bool)
    for p in range(t):
        n = (p + 1) // kpool
        if n <= select:
            mask[p, : p + 1] = True
            continue
        scores = (F.relu(q[p] @ keys[:n].T * dim**-0.5) * head_weights[p][:, None]).sum(0)
        ranked = sorted(range(n), key=lambda j: (-float(scores[j]), j))[:select]
        for j in ranked:
            mask[p, j * kpool : (j + 1) * kpool] = True
        mask[p, n * kpool : p + 1] = True
    return mask


def mla(w: dict, pre: str, x: torch.Tensor, cfg: Glm5NextArchConfig) -> torch.Tensor:
    """NoPE MLA (softmax scale ``qk_nope_head_dim^-½``) over the indexer's tokens."""
    t, heads, nope, v_dim = x.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    eps = cfg.rms_norm_eps
    q_resid = rms_norm(linear(w, pre + "q_a_proj", x), w[pre + "q_a_layernorm.weight"], eps)
    q = linear(w, pre + "q_b_proj", q_resid).view(t, heads, nope)
    latent = rms_norm(linear(w, pre + "kv_a_proj_with_mqa", x), w[pre + "kv_a_layernorm.weight"], eps)
    kv = linear(w, pre + "kv_b_proj", latent).view(t, heads, nope + v_dim)
    k, v = kv[..., :nope], kv[..., nope:]
    mask = index_mask(w, pre + "indexer.", x, q_resid, cfg)
    scores = torch.einsum("qhd,khd->hqk", q, k) * nope**-0.5
    out = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)
    return linear(w, pre + "o_proj", out.reshape(t, heads * v_dim))


def mtp_logits(
    w: dict, hidden: torch.Tensor, next_tokens: torch.Tensor, cfg: Glm5NextArchConfig
) -> torch.Tensor:
    """MTP layer 0 over rows ``0 .. T-1``: row ``q`` predicts token ``q + 2`` from ``hidden[q]`` (the pre-final-norm
    streams' mean) and token ``q + 1`` (``next_tokens[q]``)."""
    pre, eps = f"model.language_model.layers.{cfg.num_hidden_layers}.", cfg.rms_norm_eps
    e = rms_norm(w["model.language_model.embed_tokens.weight"][next_tokens], w[pre + "enorm.weight"], eps)
    h = rms_norm(hidden, w[pre + "hnorm.weight"], eps)
    x = torch.cat([e, h], dim=-1) @ w[pre + "eh_proj.weight"].T
    x = x + mla(w, pre + "self_attn.", rms_norm(x, w[pre + "input_layernorm.weight"], eps), cfg)
    x = x + moe(w, pre + "mlp.", rms_norm(x, w[pre + "post_attention_layernorm.weight"], eps), cfg)
    return rms_norm(x, w[pre + "shared_head.norm.weight"], eps) @ w["lm_head.weight"].T
