"""An independent float64 reference for DeepSeek-V4.1-Flash (``deepseek_v41``), written from the release's
config and its published architecture (the release's ``inference/model.py`` as the original engine,
github.com/HawkBearPig/dgpp ``src/models/dsv41`` and ``src/kernels/csa2.*``, reproduces it). It imports nothing
from dgpp: the checkpoint is read as raw safetensors and every packed weight is decoded from its bit fields
(``deepseek_v41_formats``).

The walk (single-pass hyper-connections, ``hc_mult`` streams):

    x = embed(token) on every stream;  pre = (1, 0, ..., 0)
    per layer:  (Engram layers: x = engram(x))
                (pre_a, post_a, comb_a) = mixes(x, hc_attn);  x = post_a * CSA2(attn_norm(collapse(x, pre))) + comb_a^T x
                (pre_f, post_f, comb_f) = mixes(x, hc_ffn);   x = post_f * MoE(ffn_norm(collapse(x, pre_a))) + comb_f^T x
                pre = pre_f
    logits = head(norm(collapse(x, pre)))

``mixes``: the ``hc_mult * hidden`` streams RMS-normalised (no weight), projected by ``fn`` ``[(2 + hc) hc, hc
hidden]``; ``pre = sigmoid(m0 * scale0 + base0) + hc_eps``, ``post = 2 sigmoid(m1 * scale1 + base1)``, ``comb`` the
``[hc, hc]`` softmax over its last axis plus ``hc_eps``, then column-normalised, then ``hc_sinkhorn_iters - 1``
row / column normalisations (each sum plus ``hc_eps``); the residual update is ``out_k = post_k y + sum_j comb[j,
k] x_j``. MoE: ``sqrt(softplus(u gate^T))`` scores, the top ``num_experts_per_tok`` of ``scores + bias`` chosen,
weighted by their unbiased scores normalised (sum + 1e-20) and times ``routed_scaling_factor``; SwiGLU experts
with the up branch clamped to ``+-swiglu_limit`` and the gate branch from above; one shared expert.

Prefill-exact semantics: every row sees exactly what a one-shot prefill shows it. ``ReferenceSession.extend``
takes the rows in any chunks (one at a time is the decode form) and gives the same logits as ``forward``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from deepseek_v41_formats import (
    RawTensor,
    decode_engram_rows,
    decode_fp8_block,
    decode_mxfp4,
    read_safetensors,
)
from deepseek_v41_reference_config import V41Config, load_config
from deepseek_v41_reference_csa2 import CallShared, GroupCache, ReferenceOptions, attention, rms_norm
from deepseek_v41_reference_engram import EngramHasher, compressed_token_map, engram

F64 = torch.float64
Weights = dict[str, torch.Tensor]

__all__ = ["DeepseekV41Reference", "ReferenceOptions", "ReferenceSession", "load_reference", "load_weights"]


# ---- the checkpoint -------------------------------------------------------------------------------------------------


def _shards(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [checkpoint_dir / f for f in files]
    return sorted(checkpoint_dir.glob("*.safetensors"))


def decode_tensors(stored: dict[str, RawTensor]) -> Weights:
    """The release's tensors -> float64 by name: packed ``X.weight`` + ``X.scale`` pairs become one decoded
    ``X.weight`` (E4M3 + 32 x 32 E8M0 blocks; I8 MXFP4 pairs + E8M0 / 32; Engram rows E4M3 + E8M0 / 32)."""
    out: Weights = {}
    for name, t in stored.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in stored:
            continue
        base = name[: -len(".weight")]
        scale = stored.get(base + ".scale") if name.endswith(".weight") else None
        if t.dtype == "F8_E4M3":
            if scale is None:
                raise ValueError(f"{name}: an F8_E4M3 weight without {base}.scale")
            if ".engram.embed." in name:
                out[name] = decode_engram_rows(t.codes(), scale.codes())
            else:
                out[name] = decode_fp8_block(t.codes(), scale.codes())
        elif t.dtype == "I8" and scale is not None:
            out[name] = decode_mxfp4(t.codes(), scale.codes())
        else:
            out[name] = t.to_f64()
    return out


def load_weights(checkpoint_dir: str | Path) -> Weights:
    stored: dict[str, RawTensor] = {}
    for shard in _shards(Path(checkpoint_dir)):
        stored.update(read_safetensors(shard))
    return decode_tensors(stored)


# ---- hyper-connections and MoE -----------------------------------------------------------------------------------


def hc_mixes(cfg: V41Config, x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor):
    hc = cfg.hc_mult
    flat = rms_norm(x.flatten(1), None, cfg.rms_norm_eps)
    m = flat @ fn.T
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc).softmax(-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre[..., None] * x).sum(1)


def expand(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return post[..., None] * y[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, x)


def expert(cfg: V41Config, w: Weights, p: str, u: torch.Tensor) -> torch.Tensor:
    gate, up = u @ w[p + "w1.weight"].T, u @ w[p + "w3.weight"].T
    if cfg.swiglu_limit > 0:
        up = up.clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        gate = gate.clamp(max=cfg.swiglu_limit)
    return F.silu(gate) * up


def moe(cfg: V41Config, w: Weights, layer: int, u: torch.Tensor) -> torch.Tensor:
    p = f"layers.{layer}.ffn."
    logits = (u @ w[p + "gate.weight"].T) / cfg.gate_temp
    if cfg.scoring_func == "softmax":
        scores = logits.softmax(-1)
    elif cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softplus(logits).sqrt()
    biased = scores + w[p + "gate.bias"]
    chosen = torch.sort(-biased, dim=-1, stable=True).indices[:, : cfg.num_experts_per_tok]
    weights = scores.gather(1, chosen)
    if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    out = expert(cfg, w, p + "shared_experts.", u) @ w[p + "shared_experts.w2.weight"].T
    for t in range(u.shape[0]):
        for e, g in zip(chosen[t].tolist(), weights[t].tolist(), strict=True):
            q = f"{p}experts.{e}."
            out[t] += g * (expert(cfg, w, q, u[t]) @ w[q + "w2.weight"].T)
    return out


# ---- the model ----------------------------------------------------------------------------------------------------


@dataclass
class ReferenceSession:
    """One sequence's state: the tokens so far, every layer's window latents, the kv sources' groups."""

    model: DeepseekV41Reference
    tokens: list[int] = field(default_factory=list)
    window: list[torch.Tensor] = field(default_factory=list)
    groups: dict[int, GroupCache] = field(default_factory=dict)

    def extend(self, token_ids: list[int]) -> torch.Tensor:
        """The next rows' logits ``[len(token_ids), vocab]`` (float64)."""
        return self.model.run(self, list(token_ids))


class DeepseekV41Reference:
    def __init__(
        self, cfg: V41Config, weights: Weights, hasher: EngramHasher | None, options: ReferenceOptions
    ):
        self.cfg, self.w, self.hasher, self.options = cfg, weights, hasher, options

    def new_session(self) -> ReferenceSession:
        empty = torch.zeros(0, self.cfg.head_dim, dtype=F64)
        return ReferenceSession(self, window=[empty] * self.cfg.num_hidden_layers)

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Every row's logits ``[T, vocab]`` of a one-shot prefill."""
        return self.new_session().extend(token_ids)

    def run(self, session: ReferenceSession, new: list[int]) -> torch.Tensor:
        cfg, w, opts = self.cfg, self.w, self.options
        pos0 = len(session.tokens)
        session.tokens.extend(new)
        positions = torch.arange(pos0, pos0 + len(new))
        shared = CallShared(groups=session.groups)
        x = w["embed.weight"][torch.tensor(new, dtype=torch.long)][:, None, :].repeat(1, cfg.hc_mult, 1)
        pre = torch.zeros(len(new), cfg.hc_mult, dtype=F64)
        pre[:, 0] = 1.0
        for layer in range(cfg.num_hidden_layers):
            p = f"layers.{layer}."
            if layer in cfg.engram_layer_ids and opts.engram:
                if self.hasher is None:
                    raise ValueError("the Engram layers need the tokenizer's token map")
                index = cfg.engram_layer_ids.index(layer)
                x = engram(
                    cfg,
                    w,
                    layer,
                    x,
                    self.hasher.rows(session.tokens, range(pos0, len(session.tokens)), index),
                )
            pre_a, post_a, comb_a = hc_mixes(
                cfg, x, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"], w[p + "hc_attn_base"]
            )
            u = rms_norm(
                collapse(x, pre if opts.single_pass_hc else pre_a),
                w[p + "attn_norm.weight"],
                cfg.rms_norm_eps,
            )
            x = expand(
                attention(cfg, opts, w, layer, u, positions, session.window, shared), x, post_a, comb_a
            )
            pre_f, post_f, comb_f = hc_mixes(
                cfg, x, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"], w[p + "hc_ffn_base"]
            )
            u = rms_norm(
                collapse(x, pre_a if opts.single_pass_hc else pre_f),
                w[p + "ffn_norm.weight"],
                cfg.rms_norm_eps,
            )
            x = expand(moe(cfg, w, layer, u), x, post_f, comb_f)
            pre = pre_f
        h = rms_norm(collapse(x, pre), w["norm.weight"], cfg.rms_norm_eps)
        return h @ w["head.weight"].T


def load_reference(
    checkpoint_dir: str | Path, options: ReferenceOptions | None = None
) -> DeepseekV41Reference:
    """The reference of a release-layout checkpoint directory (``config.json``, ``*.safetensors``, and
    ``tokenizer.json`` when the config has Engram layers)."""
    ckpt = Path(checkpoint_dir)
    cfg = load_config(ckpt)
    hasher = None
    if cfg.engram_layer_ids:
        token_map, _ = compressed_token_map(ckpt / "tokenizer.json")
        hasher = EngramHasher.build(cfg, token_map)
    return DeepseekV41Reference(cfg, load_weights(ckpt), hasher, options or ReferenceOptions())
