"""DeepSeek-V4.1-Flash's DSpark draft block in float64, from the checkpoint's tensors (``mtp.<s>.*``) as the
original engine computes it (github.com/HawkBearPig/dgpp, ``src/models/dsv41/model.cpp`` ``draft_first``; the
stages are window-only CSA2 layers, ``src/kernels/csa2.hpp`` ``csa2_dspark_window_slots``). Imports nothing from
dgpp.

Given the target's features of the rows before position ``c`` (per row the mean over the streams entering the
attention of each ``dspark_target_layer_ids`` layer, concatenated):

- ``main_x = rms(main_proj(features)) * main_norm``; each stage's context row at ``p`` is that stage's window
  latent of ``main_x`` at ``p`` as the ring stores it: ``fp8(rope(rms(wkv(main_x)) * kv_norm, p))``;
- the block ``[anchor, noise x (block - 1)]`` at ``c .. c + block - 1``, the embedding on every stream, runs
  through the stages: single-pass hyper-connections (the first collapse with ``[1, 0, 0, 0]``, each later one
  with the previous site's ``pre``), attention of every block row over the context rows of ``max(0, c - window)
  .. c - 1`` and the whole block (its own latents stored the same way), sinks in the denominator, the output's
  rotation removed, the grouped output; then the stage's MoE (``dspark_num_experts_per_tok`` of its experts);
- the streams collapsed with the last site's ``pre`` (``x_k``), ``rms(x_k) * norm`` times the head: the base
  logits; row ``k`` drafts ``argmax(base_k + markov_w2 markov_w1[prev])`` (``prev`` the block's anchor token, then the last
  draft) with confidence ``sigmoid(proj . [x_k | markov_w1[prev]])``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from deepseek_v41_reference import collapse, expand, hc_mixes, load_weights, moe
from deepseek_v41_reference_config import parse_config
from deepseek_v41_reference_csa2 import rms_norm, rope_inv_freq, rotate_tail, round_fp8_e8m0

F64 = torch.float64


class DSparkReference:
    def __init__(self, checkpoint: str | Path) -> None:
        root = json.loads((Path(checkpoint) / "config.json").read_text())
        text = root["text_config"]
        self.cfg = parse_config(root)
        self.w = load_weights(checkpoint)
        self.block = int(text["dspark_block_size"])
        self.noise = int(text["dspark_noise_token_id"])
        self.stages = int(text["num_nextn_predict_layers"])
        self.top_k = int(text["dspark_num_experts_per_tok"])
        self.inv_freq = rope_inv_freq(self.cfg, compressed=False)

    def rms(self, x: torch.Tensor, weight: str) -> torch.Tensor:
        return rms_norm(x, self.w[weight], self.cfg.rms_norm_eps)

    def latent(self, p: str, u: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        kv = self.rms(u @ self.w[p + "attn.wkv.weight"].T, p + "attn.kv_norm.weight")
        return round_fp8_e8m0(rotate_tail(kv, positions, self.inv_freq))

    def attention(self, p: str, u: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        heads, hd = cfg.num_attention_heads, cfg.head_dim
        qr = self.rms(u @ w[p + "attn.wq_a.weight"].T, p + "attn.q_norm.weight")
        q = rotate_tail((qr @ w[p + "attn.wq_b.weight"].T).view(-1, heads, hd), positions, self.inv_freq)
        scores = torch.einsum("thd,nd->thn", q, keys) * hd**-0.5
        sink = w[p + "attn.attn_sink"].view(1, heads)
        top = torch.maximum(scores.amax(-1), sink)
        probs = torch.exp(scores - top[..., None])
        out = torch.einsum("thn,nd->thd", probs, keys) / (probs.sum(-1) + torch.exp(sink - top))[..., None]
        out = rotate_tail(out, positions, self.inv_freq, inverse=True)
        wo_a = w[p + "attn.wo_a.weight"].view(cfg.o_groups, cfg.o_lora_rank, -1)
        low = torch.einsum("tgk,grk->tgr", out.reshape(out.shape[0], cfg.o_groups, -1), wo_a).flatten(1)
        return low @ w[p + "attn.wo_b.weight"].T

    def draft_block(
        self, features: torch.Tensor, c: int, anchor: int
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
        """(base logits ``[block, vocab]``, collapsed streams ``[block, hidden]``, drafts, confidences) of the
        block at ``c`` after the context whose target features are ``features`` (rows 0 .. c - 1)."""
        cfg, w = self.cfg, self.w
        lo = max(0, c - cfg.sliding_window)
        context_positions, positions = torch.arange(lo, c), torch.arange(c, c + self.block)
        main_x = self.rms(features[lo:c].to(F64) @ w["mtp.0.main_proj.weight"].T, "mtp.0.main_norm.weight")
        tokens = torch.tensor([anchor] + [self.noise] * (self.block - 1))
        x = w["embed.weight"][tokens][:, None, :].repeat(1, cfg.hc_mult, 1)
        pre = torch.zeros(self.block, cfg.hc_mult, dtype=F64)
        pre[:, 0] = 1.0
        for s in range(self.stages):
            p, layer = f"mtp.{s}.", cfg.num_hidden_layers + s
            pre_a, post_a, comb_a = hc_mixes(
                cfg, x, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"], w[p + "hc_attn_base"]
            )
            u = self.rms(collapse(x, pre), p + "attn_norm.weight")
            keys = torch.cat([self.latent(p, main_x, context_positions), self.latent(p, u, positions)])
            x = expand(self.attention(p, u, positions, keys), x, post_a, comb_a)
            pre, post_f, comb_f = hc_mixes(
                cfg, x, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"], w[p + "hc_ffn_base"]
            )
            u = self.rms(collapse(x, pre_a), p + "ffn_norm.weight")
            x = expand(moe(cfg, w, layer, u, p, self.top_k), x, post_f, comb_f)
        last = f"mtp.{self.stages - 1}."
        collapsed = collapse(x, pre)
        base = self.rms(collapsed, last + "norm.weight") @ w["head.weight"].T
        w1, w2 = w[last + "markov_head.markov_w1.weight"], w[last + "markov_head.markov_w2.weight"]
        proj = w[last + "confidence_head.proj.weight"][0]
        prev, drafts, confidence = anchor, [], []
        for k in range(self.block):
            e = w1[prev]
            confidence.append(torch.sigmoid(torch.cat([collapsed[k], e]) @ proj))
            prev = int(torch.argmax(base[k] + e @ w2.T))
            drafts.append(prev)
        return base, collapsed, drafts, torch.stack(confidence)
