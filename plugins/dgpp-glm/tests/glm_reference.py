"""A float64 reference for glm4_moe written from the spec (the GLM-4.5 report), independent of
both transformers and dgpp: one sequence, full causal attention, no cache. Used to judge the MTP layer,
which transformers does not load with the main model."""

from __future__ import annotations

import torch

from dgpp_glm.config import Glm4MoeArchConfig

F64 = torch.float64


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_half_split(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of every head: pair ``i`` is (x[i], x[i + rotary_dim/2])."""
    half = rotary_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=F64) * 2 / rotary_dim)
    angle = positions.to(F64)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], dim=-1)


def linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    y = x @ w[name + ".weight"].T
    bias = w.get(name + ".bias")
    return y if bias is None else y + bias


def attention(
    w: dict, pre: str, x: torch.Tensor, positions: torch.Tensor, cfg: Glm4MoeArchConfig
) -> torch.Tensor:
    t, d = x.shape[0], cfg.head_dim
    q = linear(w, pre + "q_proj", x).view(t, cfg.num_attention_heads, d)
    k = linear(w, pre + "k_proj", x).view(t, cfg.num_key_value_heads, d)
    v = linear(w, pre + "v_proj", x).view(t, cfg.num_key_value_heads, d)
    if cfg.use_qk_norm:
        q = rms_norm(q, w[pre + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[pre + "k_norm.weight"], cfg.rms_norm_eps)
    q = rope_half_split(q, positions, cfg.rotary_dim, cfg.rope_theta)
    k = rope_half_split(k, positions, cfg.rotary_dim, cfg.rope_theta)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)
    return linear(w, pre + "o_proj", out)


def swiglu_mlp(w: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = linear(w, pre + "gate_proj", x), linear(w, pre + "up_proj", x)
    return linear(w, pre + "down_proj", torch.nn.functional.silu(gate) * up)


def route(w: dict, pre: str, x: torch.Tensor, cfg: Glm4MoeArchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores; choose on score + correction bias within the ``topk_group`` groups whose two best
    biased scores sum highest; weight by the unbiased scores, renormalized, times the routed scale."""
    scores = torch.sigmoid(x @ w[pre + "gate.weight"].T)
    biased = scores + w[pre + "gate.e_score_correction_bias"]
    per_group = cfg.n_routed_experts // cfg.n_group
    grouped = biased.view(-1, cfg.n_group, per_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
    allowed = keep[:, :, None].expand_as(grouped).reshape(biased.shape)
    ids = biased.masked_fill(~allowed, float("-inf")).topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def moe(w: dict, pre: str, x: torch.Tensor, cfg: Glm4MoeArchConfig) -> torch.Tensor:
    ids, weights = route(w, pre, x, cfg)
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[row, slot])
            out[row] += weights[row, slot] * swiglu_mlp(w, f"{pre}experts.{expert}.", x[row : row + 1])[0]
    if cfg.n_shared_experts:
        out = out + swiglu_mlp(w, pre + "shared_experts.", x)
    return out


def decoder_layer(
    w: dict, layer: int, x: torch.Tensor, positions: torch.Tensor, cfg: Glm4MoeArchConfig
) -> torch.Tensor:
    pre = f"model.layers.{layer}."
    h = x + attention(
        w,
        pre + "self_attn.",
        rms_norm(x, w[pre + "input_layernorm.weight"], cfg.rms_norm_eps),
        positions,
        cfg,
    )
    normed = rms_norm(h, w[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    mlp = (
        moe(w, pre + "mlp.", normed, cfg) if cfg.is_moe_layer(layer) else swiglu_mlp(w, pre + "mlp.", normed)
    )
    return h + mlp


def main_hidden(w: dict, tokens: torch.Tensor, cfg: Glm4MoeArchConfig) -> torch.Tensor:
    """Post-final-norm hidden states of the main stack for one sequence."""
    positions = torch.arange(tokens.shape[0])
    x = w["model.embed_tokens.weight"][tokens]
    for layer in range(cfg.num_hidden_layers):
        x = decoder_layer(w, layer, x, positions, cfg)
    return rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)


def mtp_logits(
    w: dict, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor, cfg: Glm4MoeArchConfig
) -> torch.Tensor:
    """MTP layer 0: row ``i`` predicts token ``i + 2`` from ``hidden[i]`` (post-final-norm) and the embedding
    of token ``i + 1``: ``eh_proj([enorm(embed(next)) | hnorm(hidden)])`` -> a decoder layer -> shared head."""
    layer = cfg.num_hidden_layers
    pre = f"model.layers.{layer}."
    embed = w.get(pre + "embed_tokens.weight", w["model.embed_tokens.weight"])
    head = w.get(pre + "shared_head.head.weight", w["lm_head.weight"])
    e = rms_norm(embed[next_tokens], w[pre + "enorm.weight"], cfg.rms_norm_eps)
    h = rms_norm(hidden, w[pre + "hnorm.weight"], cfg.rms_norm_eps)
    x = torch.cat([e, h], dim=-1) @ w[pre + "eh_proj.weight"].T
    x = decoder_layer(w, layer, x, positions, cfg)
    return rms_norm(x, w[pre + "shared_head.norm.weight"], cfg.rms_norm_eps) @ head.T


def load_f64(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v.to(F64) for k, v in load_file(str(path)).items()}
