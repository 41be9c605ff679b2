"""The DFlash2 block drafter for the Qwen3.5 text models (Qwen3.8-27B): a checkpoint of its own
(``engine.dflash_model``, ``dgpp_qwen.dflash2_config``) run as a ``BlockDrafter`` under ``engine.mtp``, as the
original engine runs it (github.com/HawkBearPig/dgpp, ``src/kernels/dflash2.hpp``; ``src/engine/speculative.hpp``).

* **Features.** The target keeps, per row, the output of each layer of ``dflash_config.target_layer_ids``,
  concatenated (``Qwen35ForCausalLM.feature_layers``). ``fused = hidden_norm(fc(features))``.
* **Context.** Each drafter layer's K/V row at position ``p``: ``k = rope(k_norm(k_proj(fused)), p)`` per head,
  ``v = v_proj(fused)``; one paged row per position (``dflash.layers.<l>``).
* **Block.** At position ``c`` the rows ``[x, mask x (block - 1)]`` at ``c .. c + block - 1`` (``x`` the last
  emitted token, embedded with the target's table) run through the Qwen3 layers, each
  ``resid += conv1(o_proj(attention(conv0(input_norm(resid)))))``, then ``resid += conv1'(mlp(conv0'(
  post_norm(resid))))``. A conv is the 2-tap dynamic grouped convolution along the block
  (``out[r] = sum_t (base[side, t] + delta[r, side, t, group]) * in[r - t]``, taps never crossing the block's
  first row; ``delta = kernel_projection`` of the sublayer's normed input; side 0 before the sublayer, side 1
  after it). Attention: GQA with per-head q/k norms and rotate-half RoPE; a row at ``q`` sees the context rows
  at ``p`` with ``q - p < sliding_window`` and every row of its block (bidirectional).
* **Proposal.** The mask rows through ``norm`` and the target's head; each row's ``selector_top_k`` candidates
  (by logit, ties to the lower id) are walked greedily: draft ``l`` is the candidate ``c`` maximizing
  ``logit_c + <pred[prev] * hidden_projection(h_l), succ[c]>`` (``prev``: ``x`` for the first draft, then the
  previous draft), the ``candidate_selector`` codebooks being ``[vocab, rank]``. A draft's confidence is its
  probability under its row's logits.

The drafter's weights are held in the target's dtype and replicated on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dgpp.nn.norm import rms_normalize
from dgpp.nn.paged_context import context_rows
from dgpp.plugin_api import CacheSpec, CheckpointError, ForwardBatch, LoadContext, PagedKV
from dgpp_qwen.dflash2_config import KEY, DFlash2Config, drafter_dir, read_tensors
from dgpp_qwen.qwen3_5 import Qwen35ForCausalLM

_LAYER = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "attention_conv.base_kernel",
    "attention_conv.kernel_projection.weight",
    "mlp_conv.base_kernel",
    "mlp_conv.kernel_projection.weight",
)
_GLOBAL = (
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)


def expected_shapes(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the drafter reads, by name, with its shape."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    conv = (2 * cfg.conv_taps * (h // cfg.conv_group_size), h)
    layer = dict(
        zip(
            _LAYER,
            [(h,), (h,), (q, h), (kv, h), (kv, h), (h, q), (hd,), (hd,), (i, h), (i, h), (h, i)]
            + [(2, cfg.conv_taps, h), conv, (2, cfg.conv_taps, h), conv],
            strict=True,
        )
    )
    shapes = {f"layers.{n}.{k}": s for n in range(cfg.num_hidden_layers) for k, s in layer.items()}
    rank, vocab = cfg.selector_rank, cfg.vocab_size
    shapes.update(
        zip(
            _GLOBAL,
            [(h, len(cfg.target_layer_ids) * h), (h,), (h,), (vocab, rank), (vocab, rank), (rank, h)],
            strict=True,
        )
    )
    return shapes


class DFlash2Drafter:
    """A DFlash2 checkpoint's drafter over ``model`` (the target's embedding and head are shared)."""

    def __init__(
        self, model: Qwen35ForCausalLM, cfg: DFlash2Config, weights: dict[str, torch.Tensor]
    ) -> None:
        self.model, self.cfg, self.w = model, cfg, weights
        self.drafts = cfg.drafts
        self.dtype = model.cfg.dtype
        hd = cfg.head_dim
        self.inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        model.feature_layers = cfg.target_layer_ids

    def cache_spec(self) -> dict[str, CacheSpec]:
        cfg = self.cfg
        spec = PagedKV(num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=self.dtype)
        return {_cache_name(n): spec for n in range(cfg.num_hidden_layers)}

    # ---- pieces ---------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """The plain Qwen3 RMSNorm ``w * x / rms(x)`` (fp32 inside)."""
        return (self.w[name].float() * rms_normalize(x, self.cfg.rms_norm_eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE over each head's whole ``[rows, heads, head_dim]``."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = torch.cat([freqs.cos(), freqs.cos()], dim=-1)[:, None, :]
        sin = torch.cat([freqs.sin(), freqs.sin()], dim=-1)[:, None, :]
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * cos + turned.float() * sin).to(x.dtype)

    def _heads(self, x: torch.Tensor, name: str, heads: int, positions: torch.Tensor) -> torch.Tensor:
        """``name``'s projection of ``x`` as ``[rows, heads, head_dim]``, per-head normed (``*_norm``), rotated."""
        rows = x.shape[0]
        out = F.linear(x, self.w[f"{name}_proj.weight"]).view(rows, heads, self.cfg.head_dim)
        return self._rope(self._norm(out, f"{name}_norm.weight"), positions)

    def _conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, side: int) -> torch.Tensor:
        """The 2-tap dynamic grouped convolution of one side along each block (``x [B, rows, H]``)."""
        cfg = self.cfg
        taps, groups = cfg.conv_taps, cfg.hidden_size // cfg.conv_group_size
        per_row = delta.view(*x.shape[:2], 2, taps, groups)[:, :, side].repeat_interleave(
            cfg.conv_group_size, -1
        )
        coef = base[side].float() + per_row.float()  # [B, rows, taps, H]
        out = coef[:, :, 0] * x.float()
        for t in range(1, taps):
            out[:, t:] += coef[:, t:, t] * x[:, :-t].float()
        return out.to(x.dtype)

    def _attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, layer: int
    ) -> torch.Tensor:
        """Each block's rows over its context (windowed, before ``c``) and its whole block, every request in one
        masked product; ``q [B, rows, NH, HD]``."""
        cfg = self.cfg
        keys, values = batch.cache.kv[_cache_name(layer)]
        flat_k, flat_v = keys.view(-1, *keys.shape[2:]), values.view(-1, *values.shape[2:])
        rows, group = q.shape[1], cfg.num_attention_heads // cfg.num_key_value_heads
        window, ends = cfg.sliding_window, batch.context_lens_cpu
        firsts = [0 if window is None else max(0, c - window + 1) for c in ends]
        bs, tables = batch.cache.block_size, batch.block_tables
        context_k, positions, valid = context_rows(flat_k, tables, bs, firsts, ends)
        context_v = context_rows(flat_v, tables, bs, firsts, ends)[0]
        key = torch.cat([context_k, k], dim=1).float().repeat_interleave(group, dim=2)
        value = torch.cat([context_v, v], dim=1).float().repeat_interleave(group, dim=2)
        scores = torch.einsum("brhd,bkhd->bhrk", q.float(), key) / cfg.head_dim**0.5
        hidden = ~valid[:, None, :]  # [B, 1, L]: padding columns
        if window is not None:  # a context row at p is seen from q when q - p < window
            at = torch.tensor(ends, dtype=torch.int64, device=q.device)[:, None] + torch.arange(
                rows, device=q.device
            )
            hidden = hidden | ((at[:, :, None] - positions[:, None, :]) >= window)
        width = positions.shape[1]
        scores[..., :width] = scores[..., :width].masked_fill(hidden[:, None], float("-inf"))
        return torch.einsum("bhrk,bkhd->brhd", scores.softmax(dim=-1), value).to(q.dtype)

    # ---- the drafter ----------------------------------------------------------------------------
    @torch.no_grad()
    def absorb(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        cfg = self.cfg
        fused = self._norm(F.linear(features.to(self.dtype), self.w["fc.weight"]), "hidden_norm.weight")
        for n in range(cfg.num_hidden_layers):
            k = self._heads(fused, f"layers.{n}.self_attn.k", cfg.num_key_value_heads, batch.positions)
            v = F.linear(fused, self.w[f"layers.{n}.self_attn.v_proj.weight"])
            keys, values = batch.cache.kv[_cache_name(n)]
            keys.view(-1, *keys.shape[2:])[batch.slot_mapping] = k.to(keys.dtype)
            values.view(-1, *values.shape[2:])[batch.slot_mapping] = v.view_as(k).to(values.dtype)

    def mask_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each block's mask rows after the final norm ``[B, drafts, H]`` and its anchor tokens ``[B]``."""
        cfg, w = self.cfg, self.w
        n, rows = batch.num_seqs, cfg.block_size
        anchors = batch.input_ids[batch.query_start_loc[1:].long() - 1]
        tokens = torch.full((n, rows), cfg.mask_token_id, dtype=torch.int64, device=anchors.device)
        tokens[:, 0] = anchors
        starts = torch.tensor(batch.context_lens_cpu, dtype=torch.int64, device=anchors.device)
        positions = (starts[:, None] + torch.arange(rows, device=anchors.device)).reshape(-1)
        resid = self.model.model.embed_tokens(tokens.reshape(-1)).view(n, rows, -1)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        for layer in range(cfg.num_hidden_layers):
            p = f"layers.{layer}."
            x = self._norm(resid, p + "input_layernorm.weight")
            delta = F.linear(x, w[p + "attention_conv.kernel_projection.weight"])
            xc = self._conv(x, delta, w[p + "attention_conv.base_kernel"], 0).reshape(n * rows, -1)
            q = self._heads(xc, p + "self_attn.q", heads, positions).view(n, rows, heads, -1)
            k = self._heads(xc, p + "self_attn.k", kv_heads, positions).view(n, rows, kv_heads, -1)
            v = F.linear(xc, w[p + "self_attn.v_proj.weight"]).view(n, rows, kv_heads, -1)
            attended = self._attention(q, k, v, batch, layer).reshape(n, rows, -1)
            o = F.linear(attended, w[p + "self_attn.o_proj.weight"])
            resid = resid + self._conv(o, delta, w[p + "attention_conv.base_kernel"], 1)
            x = self._norm(resid, p + "post_attention_layernorm.weight")
            delta = F.linear(x, w[p + "mlp_conv.kernel_projection.weight"])
            xc = self._conv(x, delta, w[p + "mlp_conv.base_kernel"], 0)
            mlp = F.linear(
                F.silu(F.linear(xc, w[p + "mlp.gate_proj.weight"]))
                * F.linear(xc, w[p + "mlp.up_proj.weight"]),
                w[p + "mlp.down_proj.weight"],
            )
            resid = resid + self._conv(mlp, delta, w[p + "mlp_conv.base_kernel"], 1)
        return self._norm(resid[:, 1:], "norm.weight"), anchors

    @torch.no_grad()
    def draft(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, w = self.cfg, self.w
        hidden, anchors = self.mask_rows(batch)
        n, drafts = hidden.shape[:2]
        logits = self.model.compute_logits(hidden.reshape(n * drafts, -1)).float().view(n, drafts, -1)
        # each row's candidates by logit, ties to the lower id (a stable sort keeps the id order)
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., : cfg.selector_top_k]
        unary = logits.gather(-1, order)
        gate = F.linear(hidden, w["candidate_selector.hidden_projection.weight"]).float()  # [B, drafts, rank]
        pred = w["candidate_selector.predecessor_codebook"].float()
        succ = w["candidate_selector.successor_codebook"].float()
        prev, picks = anchors, []
        for step in range(drafts):
            query = pred[prev] * gate[:, step]  # [B, rank]
            scores = unary[:, step] + torch.einsum("br,bkr->bk", query, succ[order[:, step]])
            prev = order[:, step].gather(1, torch.argmax(scores, dim=-1, keepdim=True))[:, 0]
            picks.append(prev)
        tokens = torch.stack(picks, dim=1)
        confidence = torch.softmax(logits, dim=-1).gather(-1, tokens[..., None])[..., 0]
        return tokens, confidence


def _cache_name(layer: int) -> str:
    return f"dflash.layers.{layer}"


def load_dflash2(ctx: LoadContext, model: Qwen35ForCausalLM) -> DFlash2Drafter:
    """The drafter in the directory ``engine.dflash_model`` names, checked against ``model``, weights in the
    target's dtype on its device."""
    directory = drafter_dir(ctx.engine.dflash_model)
    cfg = DFlash2Config.from_dir(directory)
    target = model.cfg
    cfg.check_target(target.hidden_size, target.vocab_size, target.num_layers, directory)
    tensors = read_tensors(directory)
    device = next(model.parameters()).device
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        t = tensors.get(name)
        if t is None:
            raise CheckpointError(f"{KEY}: {directory} has no tensor {name!r}")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{KEY}: {directory}: {name!r} is {list(t.shape)}, expected {list(shape)}")
        weights[name] = t.to(device=device, dtype=target.dtype)
    return DFlash2Drafter(model, cfg, weights)
