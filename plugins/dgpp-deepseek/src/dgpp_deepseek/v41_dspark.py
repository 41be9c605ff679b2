"""DeepSeek-V4.1-Flash's DSpark draft (``engine.mtp``): the release's ``mtp.<s>`` stages
(``dgpp_deepseek.v41_draft_stages``) run as a block drafter, as the original engine runs them
(github.com/HawkBearPig/dgpp, ``src/models/dsv41/model.cpp``: ``draft_first``, ``enqueue_layer``).

* **Features.** Per row, the mean over the hyper-connection streams entering the attention of each layer of
  ``dspark_target_layer_ids`` (after that layer's Engram), concatenated in that order
  (``DeepseekV41ForCausalLM.feature_layers``).
* **Context.** ``main_x = main_norm(main_proj(features))``; each stage's context row at ``p`` is that stage's
  window latent of ``main_x``, ``rotate(kv_norm(wkv(main_x)), p)`` in the window ring's FP8 form, one paged row
  per position held packed as the ring holds it (``PackedFP8``: E4M3 codes and an E8M0 scale per 32, 528 bytes
  per 512-wide row).
* **Block.** At position ``c`` the rows ``[x, noise x (block - 1)]`` are embedded on every stream and run
  through the stages as V4.1 blocks: single-pass hyper-connections (the first stage's attention collapses with
  ``[1, 0, 0, 0]``, every later sublayer with the previous one's ``pre``), CSA2 attention without a per-head
  query norm over the context rows of ``max(0, c - window) .. c - 1`` and every row of the block (whose own
  latents are FP8-rounded like the ring's), with the stage's sinks, then the stage's MoE.
* **Head.** The streams collapsed with the last MoE's ``pre``, the last stage's ``norm`` and the target's head
  give each row's base logits; the Markov chain and the confidences are DeepSeek-V4's
  (``dgpp_deepseek.dspark.DSparkHeads``): ``logits_k = base_k + markov_w2 markov_w1[prev]``, confidence
  ``sigmoid(proj . [x_k | markov_w1[prev]])`` with ``x_k`` the collapsed (un-normed) row.

The bounded prefill (``engine.prefill_mode: bounded``) runs the decoder layers over the last window only, so the
target layers' features of the other rows do not exist: the two are refused together.
"""

from __future__ import annotations

from typing import Any

import torch

from dgpp.nn.hyper_connections import to_streams
from dgpp.nn.parallel import all_reduce
from dgpp.plugin_api import CacheSpec, ConfigError, ForwardBatch, LoadContext, Model, PagedKV
from dgpp_deepseek.attention import grouped_output
from dgpp_deepseek.config import LatentMoEFields
from dgpp_deepseek.dspark import DSparkHeads, block_attention, context_name
from dgpp_deepseek.v41_attention import DeepseekV41Attention
from dgpp_deepseek.v41_draft_stages import DSparkV41Config
from dgpp_deepseek.v41_latent_formats import round_fp8_e8m0
from dgpp_deepseek.v41_model import DeepseekV41Block, DeepseekV41ForCausalLM, collapse
from dgpp_deepseek.v41_packed_entries import PackedFP8


class DSparkV41Drafter(DSparkHeads):
    """The release's DSpark stages (``model.mtp``) as a ``BlockDrafter`` over ``model`` (its embedding and head
    are shared)."""

    def __init__(self, model: DeepseekV41ForCausalLM, dspark: DSparkV41Config) -> None:
        stages = getattr(model, "mtp", None)
        if stages is None:
            raise ConfigError("DSpark draft: the model was built without its mtp.<s> stages (engine.mtp off)")
        super().__init__(model, stages, model.config, dspark.common)
        self.stages: list[DeepseekV41Block] = list(stages)
        self.v41 = model
        model.feature_layers = dspark.common.target_layer_ids

    @property
    def stage_list(self) -> list[Any]:
        return self.stages

    def cache_spec(self) -> dict[str, CacheSpec]:
        return context_spec(self.config, len(self.stages))

    def stored_rows(self, latent: torch.Tensor) -> torch.Tensor:
        return PackedFP8(self.config.head_dim).encode(latent)

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return PackedFP8(self.config.head_dim).decode(rows, self.dtype)

    def context_latent(self, attn: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return round_fp8_e8m0(super().context_latent(attn, x, positions))

    def block_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, positions, anchors = self.block_rows(batch)
        n, block, model = batch.num_seqs, self.drafts, self.v41
        streams = to_streams(model.embed(tokens), model.config.hc_mult)
        pre = torch.zeros(streams.shape[0], model.config.hc_mult, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        for s, stage in enumerate(self.stages):
            x, pre_attn, post, comb = stage.attn_hc.collapse_given(streams, pre)
            out = self._attend(stage.attn, stage.attn_norm(x), positions, self._context(batch, s), block)
            streams = stage.attn_hc.expand(streams, out, post, comb)
            x, pre, post, comb = stage.ffn_hc.collapse_given(streams, pre_attn)
            x = stage.ffn_norm(x)
            out = all_reduce(stage.ffn(x, tokens), model.world, model.group)
            streams = stage.ffn_hc.expand(streams, out, post, comb)
        collapsed = collapse(pre, streams)
        logits = model.compute_logits(self.final_norm(collapsed)).float()
        return logits.view(n, block, -1), collapsed.view(n, block, -1), anchors

    def _attend(
        self,
        attn: DeepseekV41Attention,
        x: torch.Tensor,
        positions: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        block: int,
    ) -> torch.Tensor:
        """The stage's CSA2 window attention for the block rows ``x`` (normed), ``block_attention`` inside."""
        rows = x.shape[0]
        q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(rows, attn.num_heads, attn.head_dim)
        q = attn.rotary.rotate(q, positions)
        latent = self.context_latent(attn, x, positions)
        out = block_attention(q, latent, context, attn.attn_sink, attn.head_dim**-0.5, block)
        out = attn.rotary.rotate(out, positions, inverse=True)
        return grouped_output(attn.wo_a, attn.wo_b, out, attn.groups, attn.o_lora_rank)


def context_spec(cfg: LatentMoEFields, stages: int) -> dict[str, CacheSpec]:
    """One packed FP8 latent row per position for each stage (the key is its own value: no V)."""
    row = PackedFP8(cfg.head_dim)
    return {context_name(s): PagedKV(1, row.width, row.dtype, v_head_dim=0) for s in range(stages)}


def build_draft(ctx: LoadContext, model: Model) -> DSparkV41Drafter | None:
    """The DSpark drafter of a DeepSeek-V4.1 checkpoint that ships the stages; None otherwise."""
    if not isinstance(model, DeepseekV41ForCausalLM):
        return None
    dspark = DSparkV41Config.from_text_config(text_config(ctx.hf_config), model.config)
    if dspark is None:
        return None
    if model.bounded:
        raise ConfigError(
            "engine.mtp: the DSpark drafter reads every row's target-layer features, which "
            "engine.prefill_mode 'bounded' does not compute; use prefill_mode 'exact'"
        )
    return DSparkV41Drafter(model, dspark)


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The backbone's keys: ``text_config`` under a ``deepseek_v41`` root, else the root itself."""
    text = hf_config.get("text_config")
    return text if isinstance(text, dict) else hf_config
