"""DeepSeek-V4's DSpark draft (``engine.mtp``): the release's ``mtp.<s>`` stages (``dgpp_deepseek.draft_blocks``)
run as a block drafter (``dgpp.step.model.BlockDrafter``), as the original engine runs them
(github.com/HawkBearPig/dgpp, ``src/models/dsv41/model.cpp``, ``draft_first``).

* **Features.** The target keeps, per row, the mean over the hyper-connection streams entering each layer of
  ``dspark_target_layer_ids``, concatenated in that order (``DeepseekV4ForCausalLM.feature_layers``).
* **Context.** ``main_x = main_norm(main_proj(features))`` (stage 0's tensors); each stage's context row at
  position ``p`` is that stage's own latent of ``main_x``: ``rotate(kv_norm(wkv(main_x)), p)``, one paged row per
  position (``mtp.<s>.attn.context``).
* **Block.** At position ``c`` (the last emitted token ``x`` fed there) the rows ``[x, noise x (block - 1)]``
  (``dspark_noise_token_id``) at positions ``c .. c + block - 1`` are embedded with the target's embedding on
  every stream and run through the stages in order, each a decoder block (hyper-connections, attention, the
  stage's own MoE) whose attention reads the context rows of positions ``max(0, c - window) .. c - 1`` and every
  row of the block (bidirectional: the block is refined in one pass), with the layer's sinks.
* **Head.** The last stage's ``hc_head`` collapses the streams (``x_k``), its ``norm`` and the target's head give
  the base logits of each row. Row ``k`` drafts the token after it, in order: ``e = markov_w1[prev]`` (``prev``:
  ``x`` for row 0, else row ``k - 1``'s draft), ``logits_k = base_k + markov_w2 e``, the draft is its argmax
  (ties to the lowest id) and its confidence ``sigmoid(w . [x_k | e])`` (``confidence_head.proj``).

A block proposes ``dspark_block_size`` drafts; ``engine.mtp_depth`` verifies at most that many.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dgpp.nn.hyper_connections import to_streams
from dgpp.nn.linear import Linear
from dgpp.nn.paged_context import context_rows
from dgpp.nn.parallel import all_reduce
from dgpp.plugin_api import CacheSpec, CheckpointError, ForwardBatch, LoadContext, Model, PagedKV
from dgpp_deepseek.attention import DeepseekV4Attention
from dgpp_deepseek.config import LatentMoEFields
from dgpp_deepseek.model import DeepseekV4Block, DeepseekV4ForCausalLM

_KEYS = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids")


@dataclass(frozen=True)
class DSparkConfig:
    """The ``dspark_*`` keys of ``config.json``."""

    block_size: int
    noise_token_id: int
    target_layer_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], cfg: LatentMoEFields) -> DSparkConfig | None:
        """The checkpoint's DSpark settings; None when it names none (a release without DSpark). A
        ``CheckpointError`` names the key that is missing or out of range."""
        present = [k for k in _KEYS if hf_config.get(k) is not None]
        if not present:
            return None
        missing = [k for k in _KEYS if k not in present]
        if missing:
            raise CheckpointError(f"config.json: DSpark needs {missing[0]!r} beside {present}")
        block, noise, ids = (hf_config[k] for k in _KEYS)
        if not isinstance(block, int) or block < 1:
            raise CheckpointError(
                f"config.json: 'dspark_block_size' must be a positive integer, got {block!r}"
            )
        if not isinstance(noise, int) or not 0 <= noise < cfg.vocab_size:
            raise CheckpointError(
                f"config.json: 'dspark_noise_token_id' {noise!r} is outside the vocabulary of {cfg.vocab_size}"
            )
        layers = cfg.num_hidden_layers
        if (
            not isinstance(ids, list)
            or not ids
            or len(set(ids)) != len(ids)
            or not all(isinstance(i, int) and 0 <= i < layers for i in ids)
        ):
            raise CheckpointError(
                f"config.json: 'dspark_target_layer_ids' must list distinct layers of 0..{layers - 1}, got {ids!r}"
            )
        return cls(block, noise, tuple(ids))


def _part(stages: nn.ModuleList, stage: int, name: str) -> nn.Module:
    """The module ``mtp.<stage>.<name>`` the checkpoint's tensors made (``draft_blocks``); a ``CheckpointError``
    names it when the checkpoint has none."""
    node: Any = stages[stage]
    for part in name.split("."):
        node = getattr(node, part, None)
    if not isinstance(node, nn.Module):
        raise CheckpointError(f"DSpark draft: the checkpoint has no mtp.{stage}.{name} tensors")
    return node


def _linear(stages: nn.ModuleList, stage: int, name: str) -> Linear:
    node = _part(stages, stage, name)
    if not isinstance(node, Linear):
        raise CheckpointError(f"DSpark draft: mtp.{stage}.{name}.weight must be a matrix")
    return node


class DSparkHeads:
    """What every DSpark drafter shares over the release's stages: ``main_x`` from the target's features, one
    context latent per position and stage (``context_latent``), the Markov chain over a block's base logits and
    the confidences. A release's drafter adds its block (``block_logits``)."""

    def __init__(
        self, model: Model, stages: nn.ModuleList, cfg: LatentMoEFields, dspark: DSparkConfig
    ) -> None:
        if not len(stages):
            raise CheckpointError("DSpark draft: the checkpoint has no mtp.<s> draft stages")
        last = len(stages) - 1
        self.main_proj = _linear(stages, 0, "main_proj")
        self.main_norm = _part(stages, 0, "main_norm")
        self.final_norm = _part(stages, last, "norm")
        embed = _linear(stages, last, "markov_head.markov_w1").weight
        assert isinstance(embed, torch.Tensor)  # the release ships it dense
        self.markov_embed = embed
        self.markov_head = _linear(stages, last, "markov_head.markov_w2")
        self.confidence_head = _linear(stages, last, "confidence_head.proj")
        for s, stage in enumerate(stages):
            if getattr(stage.attn, "compressor", None) is not None:
                raise CheckpointError(
                    f"DSpark draft: mtp.{s} attention is compressed; DSpark stages are window-only"
                )
        features = self.main_proj.in_features
        if features != len(dspark.target_layer_ids) * cfg.hidden_size:
            raise CheckpointError(
                f"DSpark draft: mtp.0.main_proj reads {features} features, but 'dspark_target_layer_ids' "
                f"{list(dspark.target_layer_ids)} name {len(dspark.target_layer_ids)} layers of {cfg.hidden_size}"
            )
        self.model = model
        self.config = cfg
        self.dspark = dspark
        self.drafts = dspark.block_size
        self.window = cfg.sliding_window
        self.dtype = model.info.dtype

    def cache_spec(self) -> dict[str, CacheSpec]:
        return dspark_cache_spec(self.config, len(self.stage_list), self.dtype)

    def stored_rows(self, latent: torch.Tensor) -> torch.Tensor:
        """Context latents ``[n, head_dim]`` as the context pool holds them (here: as they are)."""
        return latent

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The context pool's rows back as latents (``stored_rows`` undone)."""
        return rows

    @property
    def stage_list(self) -> list[Any]:
        raise NotImplementedError

    # ---- context ------------------------------------------------------------------------------
    def main_x(self, features: torch.Tensor) -> torch.Tensor:
        """``main_norm(main_proj(features))``, the rows every stage's context latent is made from."""
        return self.main_norm(self.main_proj(features.to(self.dtype))).to(self.dtype)

    def context_latent(self, attn: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A stage's latent of rows ``x`` at ``positions``: ``rotate(kv_norm(wkv(x)))``."""
        return attn.rotary.rotate(attn.kv_norm(attn.wkv(x))[:, None, :], positions)[:, 0]

    @torch.no_grad()
    def absorb(self, batch: ForwardBatch, features: torch.Tensor) -> None:
        main_x = self.main_x(features)
        for s, stage in enumerate(self.stage_list):
            latent = self.context_latent(stage.attn, main_x, batch.positions)
            keys, _ = batch.cache.kv[context_name(s)]
            keys.view(-1, keys.shape[-1])[batch.slot_mapping] = self.stored_rows(latent).to(keys.dtype)

    def _context(self, batch: ForwardBatch, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``s``'s context latents of every sequence, positions ``max(0, c - window) .. c - 1``, right-aligned
        in one ``[B, L, head_dim]`` tensor, and the mask of the columns that hold one (``[B, L]``)."""
        keys, _ = batch.cache.kv[context_name(s)]
        ends = batch.context_lens_cpu
        firsts = [max(0, c - self.window) for c in ends]
        flat = keys.view(-1, keys.shape[-1])
        rows, _, valid = context_rows(flat, batch.block_tables, batch.cache.block_size, firsts, ends)
        n, width = rows.shape[:2]
        return self.read_rows(rows.reshape(n * width, -1)).view(n, width, -1), valid

    def block_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sequence's block ``[anchor, noise x (block - 1)]``: its tokens and positions (flat, block after
        block) and the anchors ``[B]``."""
        n, block = batch.num_seqs, self.drafts
        anchors = batch.input_ids[batch.query_start_loc[1:].long() - 1]
        tokens = torch.full((n, block), self.dspark.noise_token_id, dtype=torch.int64, device=anchors.device)
        tokens[:, 0] = anchors
        starts = torch.tensor(batch.context_lens_cpu, dtype=torch.int64, device=anchors.device)
        positions = (starts[:, None] + torch.arange(block, device=anchors.device)).reshape(-1)
        return tokens.reshape(-1), positions, anchors

    def block_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block of each sequence: its base logits ``[B, block, vocab]`` (fp32, before the Markov bias), the
        collapsed streams ``x_k`` ``[B, block, hidden]`` and its anchor tokens ``[B]``."""
        raise NotImplementedError

    # ---- the block ------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        base, collapsed, anchors = self.block_logits(batch)
        prev = anchors
        drafts, confidence = [], []
        for k in range(self.drafts):
            embed = self.markov_embed[prev].to(self.dtype)  # [B, rank]: the previous token's row
            logits = base[:, k].float() + self.markov_head(embed).float()
            joined = torch.cat([collapsed[:, k], embed], dim=-1)
            confidence.append(torch.sigmoid(self.confidence_head(joined).float()[:, 0]))
            prev = torch.argmax(logits, dim=-1)
            drafts.append(prev)
        return torch.stack(drafts, dim=1), torch.stack(confidence, dim=1)


def block_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    block: int,
) -> torch.Tensor:
    """Every row of a sequence's block (``q [B * block, H, D]``, its latents ``[B * block, D]``) attends to its
    context latents and to all of its block's latents, in one softmax with the head's sink (fp32 math); every
    sequence in one masked product (``context``: the latents ``[B, L, D]`` and the mask of the columns that hold
    one, ``DSparkHeads._context``)."""
    latents, valid = context
    n, width = latents.shape[:2]
    keys = torch.cat([latents.to(latent.dtype), latent.view(n, block, -1)], dim=1).float()
    scores = torch.einsum("brhd,bkd->bhrk", q.view(n, block, *q.shape[1:]).float(), keys) * scale
    scores[..., :width] = scores[..., :width].masked_fill(~valid[:, None, None, :], float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(n, -1, block, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhrk,bkd->brhd", probs, keys).reshape(q.shape).to(q.dtype)


class DSparkDrafter(DSparkHeads):
    """The release's DSpark stages as a ``BlockDrafter`` over ``model`` (its embedding and head are shared)."""

    def __init__(self, model: DeepseekV4ForCausalLM, dspark: DSparkConfig) -> None:
        stages = getattr(model, "mtp", None)
        if stages is None:
            raise CheckpointError("DSpark draft: the checkpoint has no mtp.<s> draft stages")
        super().__init__(model, stages, model.config, dspark)
        self.hc_head = _part(stages, len(stages) - 1, "hc_head")
        self.stages: list[DeepseekV4Block] = list(stages)
        model.feature_layers = dspark.target_layer_ids

    @property
    def stage_list(self) -> list[Any]:
        return self.stages

    def block_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, positions, anchors = self.block_rows(batch)
        n, block = batch.num_seqs, self.drafts
        model = self.model
        assert isinstance(model, DeepseekV4ForCausalLM)
        streams = to_streams(model.embed(tokens), model.config.hc_mult)
        for s, stage in enumerate(self.stages):
            x, post, comb = stage.attn_hc.collapse(streams)
            attended = self._attend(stage.attn, stage.attn_norm(x), positions, self._context(batch, s), block)
            streams = stage.attn_hc.expand(streams, attended, post, comb)
            x, post, comb = stage.ffn_hc.collapse(streams)
            out = all_reduce(stage.ffn(stage.ffn_norm(x), tokens), model.world, model.group)
            streams = stage.ffn_hc.expand(streams, out, post, comb)
        collapsed = self.hc_head(streams)
        logits = model.compute_logits(self.final_norm(collapsed).to(self.dtype)).float()
        return logits.view(n, block, -1), collapsed.view(n, block, -1), anchors

    def _attend(
        self,
        attn: DeepseekV4Attention,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        block: int,
    ) -> torch.Tensor:
        """The stage's attention for the block rows ``x`` (normed): V4's per-head query norm, then
        ``block_attention``."""
        rows = x.shape[0]
        q_resid = attn.q_norm(attn.wq_a(x))
        q = attn.wq_b(q_resid).view(rows, attn.num_heads, attn.head_dim)
        q = attn.rotary.rotate(q, positions, head_rms_eps=attn.eps)
        latent = self.context_latent(attn, x, positions)
        out = block_attention(q, latent, context, attn.attn_sink, attn.core.scale, block)
        out = attn.rotary.rotate(out, positions, inverse=True)
        return attn.grouped_output(out)


def context_name(stage: int) -> str:
    return f"mtp.{stage}.attn.context"


def dspark_cache_spec(cfg: LatentMoEFields, stages: int, dtype: torch.dtype) -> dict[str, CacheSpec]:
    """One latent row per position for each stage (the key is its own value: no V)."""
    return {context_name(s): PagedKV(1, cfg.head_dim, dtype, v_head_dim=0) for s in range(stages)}


def build_draft(ctx: LoadContext, model: Model) -> DSparkDrafter | None:
    """The DSpark drafter of a DeepSeek-V4 checkpoint whose config names ``dspark_*`` keys; None otherwise."""
    if not isinstance(model, DeepseekV4ForCausalLM):
        return None
    dspark = DSparkConfig.from_hf_config(ctx.hf_config, model.config)
    return None if dspark is None else DSparkDrafter(model, dspark)
