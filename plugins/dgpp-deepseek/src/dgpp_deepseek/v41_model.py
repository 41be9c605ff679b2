"""DeepSeek-V4.1-Flash (``DeepseekV41ForCausalLM``): the forward pass over the engine's caches.

The residual is ``hc_mult`` streams with single-pass hyper-connections: each sublayer's ``HyperConnection``
computes ``(pre, post, comb)`` from the streams it reads, but the sublayer's input is the streams collapsed
with the PREVIOUS sublayer's ``pre`` (the first attention's with ``[1, 0, 0, 0]``, the head's with the last
MoE's). Per layer: Engram on its layers (added to every stream), CSA2 attention (``dgpp_deepseek.v41_attention``)
behind ``attn_norm``, MoE behind ``ffn_norm`` (384 + 1 shared experts, sqrt-softplus scores with the correction
bias, renormalised top-6 times ``routed_scaling_factor``, SwiGLU clamped at ``swiglu_limit``). Module names
follow the release's tensor names (``dgpp_deepseek.names`` maps the rest).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.kernels._triton import triton_enabled
from dgpp.nn.decoder import causal_lm_info
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.hyper_connections import HyperConnection, to_streams
from dgpp.nn.moe import RoutingConfig
from dgpp.nn.parallel import all_reduce
from dgpp.nn.window_compressor import FP32WeightRMSNorm
from dgpp.plugin_api import CacheSpec, ConfigError, ForwardBatch, Model, World
from dgpp_deepseek.model import sparse_moe
from dgpp_deepseek.v41_attention import DeepseekV41Attention
from dgpp_deepseek.v41_bounded import decoder_rows, tail_spec
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_decode import packed_forms
from dgpp_deepseek.v41_engram import EngramV41
from dgpp_deepseek.v41_indexer import CompressorV41, GroupFlow, IndexerV41
from dgpp_deepseek.v41_packed_entries import EntryFormats


def collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j s_j`` in fp32, stream order fixed, in the streams' dtype."""
    out = pre[:, 0, None] * streams[:, 0].float()
    for j in range(1, streams.shape[1]):
        out = out + pre[:, j, None] * streams[:, j].float()
    return out.to(streams.dtype)


class DeepseekV41Block(nn.Module):
    """``layers.N``: optional Engram, then attention and MoE between single-pass hyper-connections."""

    def __init__(
        self,
        cfg: DeepseekV41ArchConfig,
        layer_idx: int,
        formats: EntryFormats,
        *,
        dtype: torch.dtype,
        world: World,
        index_topk: int,
    ) -> None:
        super().__init__()
        self.world, self.layer_idx = world, layer_idx
        eps = cfg.rms_norm_eps
        self.attn_hc = HyperConnection.from_config(cfg)
        self.ffn_hc = HyperConnection.from_config(cfg)
        self.engram = EngramV41(cfg, layer_idx, dtype=dtype) if layer_idx in cfg.engram_layer_ids else None
        self.attn_norm = FP32WeightRMSNorm(cfg.hidden_size, eps)
        self.attn = DeepseekV41Attention(cfg, layer_idx, formats, dtype=dtype, index_topk=index_topk)
        self.ffn_norm = FP32WeightRMSNorm(cfg.hidden_size, eps)
        routing = RoutingConfig(
            num_experts=cfg.n_routed_experts,
            top_k=cfg.num_experts_per_tok,
            scoring="sqrtsoftplus",
            renormalize=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            correction_bias=True,
            router_fp32=True,  # fp32 logits and scores: bf16 ones tie and reorder the top-6 experts
        )
        self.ffn = sparse_moe(cfg, routing, dtype=dtype, world=world)

    def forward(
        self,
        streams: torch.Tensor,
        pre: torch.Tensor,
        batch: ForwardBatch,
        flow: GroupFlow,
        group: Any = None,
        means: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(streams, pre)`` after the layer; ``pre`` is the coefficients the next sublayer collapses with.
        ``means``: receives, under this layer's index, the mean of the streams its attention reads."""
        if self.engram is not None:
            streams = self.engram(streams, batch)
        if means is not None:
            means[self.layer_idx] = streams.mean(dim=1)
        x, pre_attn, post, comb = self.attn_hc.collapse_given(streams, pre)
        out = self.attn(self.attn_norm(x), batch, flow)
        streams = self.attn_hc.expand(streams, out, post, comb)
        x, pre_ffn, post, comb = self.ffn_hc.collapse_given(streams, pre_attn)
        x = self.ffn_norm(x)
        out = all_reduce(self.ffn(x, batch.input_ids), self.world, group)
        return self.ffn_hc.expand(streams, out, post, comb), pre_ffn


class DeepseekV41ForCausalLM(Model):
    """DeepSeek-V4.1-Flash behind the engine's model contract. Every layer holds per-request state (its window
    ring; kv sources also an open pair, Engram layers their token context), so ``info.hybrid`` is set: the
    prefix cache attaches where it holds a state snapshot. With ``engine.mtp`` the release's DSpark stages hang off
    it as ``mtp`` (``dgpp_deepseek.v41_draft_stages``).

    ``last_hidden`` (while ``keep_hidden`` is on) is the DSpark drafter's features when ``feature_layers`` names
    layers: per row, the mean over the streams each of those layers' attention reads, in that order; else the
    final normed hidden."""

    #: the layers whose attention input's stream mean is kept (set by the DSpark drafter)
    feature_layers: tuple[int, ...] = ()

    def __init__(
        self,
        cfg: DeepseekV41ArchConfig,
        *,
        dtype: torch.dtype | None = None,
        world: World | None = None,
        group: Any = None,
        index_topk: int | None = None,
        bounded: bool = False,
    ) -> None:
        super().__init__()
        if bounded:
            check_bounded(cfg)
        self.bounded = bounded
        self.config = cfg
        self.dtype = dtype or cfg.dtype
        self.world = world or World()
        self.group = group
        topk = cfg.index_topk if index_topk is None else index_topk
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=self.dtype)
        # the compressed pools' forms, one object every kv source and reader holds
        self.entry_formats = EntryFormats.release(cfg.head_dim, cfg.index_head_dim)
        self.layers = nn.ModuleList(
            DeepseekV41Block(cfg, i, self.entry_formats, dtype=self.dtype, world=self.world, index_topk=topk)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = FP32WeightRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = LMHead(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=self.dtype,
            tied_to=self.embed if cfg.tie_word_embeddings else None,
            world=self.world,
            group=self.group,
        )
        self.info = causal_lm_info(cfg, self.dtype, hybrid=True)

    @property
    def decode_graph_safe(self) -> bool:  # type: ignore[override]
        """A decode step reads no host value where it runs the fused kernels over the packed caches: the
        compressors, indexers and candidate pools in batched form (``v41_decode_rows``), Engram's rows gathered
        before the step (``stage_decode``). The bounded prefill's decoder picks its rows on the host, and the
        per-sequence forms (``batched_decode`` off) or the torch attention read host values: those decode eager."""
        if self.bounded or packed_forms(self.entry_formats) is None or not triton_enabled():
            return False
        for m in self.modules():
            if isinstance(m, (CompressorV41, IndexerV41, EngramV41)) and not m.batched_decode:
                return False
            if isinstance(m, DeepseekV41Attention) and m.fused_decode is False:
                return False
        return True

    def stage_decode(self, batch: ForwardBatch) -> None:
        """Engram's rows of the step, gathered from the memory-mapped tables into the static buffers its layers
        read (``EngramV41.stage_decode``)."""
        for module in self.modules():
            if isinstance(module, EngramV41) and module.batched_decode:
                module.stage_decode(batch)

    def cache_spec(self) -> dict[str, CacheSpec]:
        spec = super().cache_spec()
        if self.bounded:
            cfg = self.config
            spec.update(tail_spec(cfg.sliding_window, cfg.hc_mult, cfg.hidden_size, self.dtype))
        return spec

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        streams = to_streams(self.embed(batch.input_ids), self.config.hc_mult)
        pre = torch.zeros(streams.shape[0], self.config.hc_mult, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0
        flow = GroupFlow()
        split = self.config.decoder_first_layer if self.bounded else len(self.layers)
        features = self.feature_layers if self.keep_hidden else ()
        means: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers[:split]):
            streams, pre = layer(streams, pre, batch, flow, self.group, means if i in features else None)
        if split < len(self.layers):
            streams, pre = self._bounded_decoder(streams, pre, batch, split)
        hidden = self.norm(collapse(pre, streams))
        self.keep_last_hidden(torch.cat([means[i] for i in features], dim=-1) if features else hidden)
        return hidden[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def _bounded_decoder(
        self, streams: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, split: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the rows ``v41_bounded`` picks; every other row's output stays zero."""
        first = self.layers[split]
        assert isinstance(first, DeepseekV41Block) and first.attn.compressor is not None
        first.attn.compressor(first.attn_norm(collapse(pre, streams)), batch)  # every row's entries
        sub = decoder_rows(batch, streams, pre, self.config.sliding_window)
        out_streams, out_pre = torch.zeros_like(streams), torch.zeros_like(pre)
        if not sub.rows.numel():
            return out_streams, out_pre
        flow = GroupFlow(window_floor=sub.floors)
        dec_streams, dec_pre = sub.streams, sub.pre
        for layer in self.layers[split:]:
            dec_streams, dec_pre = layer(dec_streams, dec_pre, sub.batch, flow, self.group)
        here = sub.rows >= 0
        out_streams[sub.rows[here]] = dec_streams[here]
        out_pre[sub.rows[here]] = dec_pre[here]
        return out_streams, out_pre


def check_bounded(cfg: DeepseekV41ArchConfig) -> None:
    """The bounded prefill's decoder reads its kv source at ratio 1 and has no Engram layer."""
    first = cfg.decoder_first_layer
    decoder = range(first, cfg.num_hidden_layers)
    if not cfg.kv_source_layer_ids or any(cfg.ratio(layer) != 1 for layer in decoder):
        raise ConfigError(
            "engine.prefill_mode 'bounded' needs every decoder layer (from the last kv source) at ratio 1"
        )
    if any(layer in cfg.engram_layer_ids for layer in decoder):
        raise ConfigError("engine.prefill_mode 'bounded' needs the Engram layers before the decoder")
