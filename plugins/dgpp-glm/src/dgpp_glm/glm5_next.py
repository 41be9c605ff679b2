"""GLM-5.3-Flash (``glm5_next``): the text model, KDA and NoPE MLA/DSA layers over mHC residual streams.

The residual is ``hc_mult`` streams per token (``dgpp.nn.hyper_connections``), every one starting as the token's
embedding. Each layer collapses them into its mixer's input (``attn_hc``) -> ``input_layernorm`` -> mixer ->
expands the output back, then the same around its MLP (``ffn_hc`` -> ``post_attention_layernorm`` -> MLP). After
the last layer the streams' unweighted mean goes through the final norm to the head.

Mixers by ``layer_types``: ``linear_attention`` layers are Kimi delta attention (``dgpp.nn.kimi_delta_attention``,
per-request conv and recurrent state); ``indexed_attention`` layers are MLA with no RoPE (``dgpp.nn.mla``, one
latent row per token, softmax scale ``qk_nope_head_dim^-½``) over the tokens the k-pooled indexer selects
(``dgpp_glm.glm5_next_indexer``); a ``shared`` indexed layer reuses the selection of the indexed layer right before
it. MLPs: dense SwiGLU in ``mlp_layer_types == 'dense'`` layers, else GLM's sigmoid-routed MoE; all clamped at
``swiglu_limit``. Module names follow the checkpoint's tensor names but for the mHC parameters (``renames``).

A nested checkpoint with a ``vision_config`` also gets its vision tower (``model.visual``,
``dgpp_glm.glm5_next_vision``): image placeholder rows take the tower's output instead of the token embedding,
before the embedding is copied into the streams.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.nn.decoder import causal_lm_info
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.hyper_connections import HyperConnection, to_streams
from dgpp.nn.image_embeddings import merge_image_embeddings
from dgpp.nn.kimi_delta_attention import KimiDeltaAttention
from dgpp.nn.mla import MultiLatentAttention, mla_softmax_scale
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.norm import RMSNorm
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.nn.selection import DeviceSelection, Selection
from dgpp.plugin_api import CacheSpec, ForwardBatch, Model, World, transformer_activation_bytes
from dgpp_glm.glm5_next_config import Glm5NextArchConfig
from dgpp_glm.glm5_next_indexer import KPoolIndexer
from dgpp_glm.glm5_next_vision import Glm5NextVisionTower
from dgpp_glm.model import build_glm_moe

# dgpp's mHC modules keep ``fn`` / ``base`` / ``scale``; the checkpoint names them per layer
_HC_NAMES = {f".{hc}_hc.{p}": f".hc_{hc}_{p}" for hc in ("attn", "ffn") for p in ("fn", "base", "scale")}


def checkpoint_name(name: str) -> str:
    """Module name -> checkpoint tensor name: the mHC parameters (``layers.N.attn_hc.fn`` is stored as
    ``layers.N.hc_attn_fn``) and the MoE's ``shared_experts``."""
    for ours, theirs in _HC_NAMES.items():
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")


class Glm5NextAttention(MultiLatentAttention):
    """``self_attn.*`` of an indexed layer: NoPE MLA plus, on ``full`` layers, its ``indexer``."""

    def __init__(
        self,
        cfg: Glm5NextArchConfig,
        layer_idx: int,
        *,
        dtype: torch.dtype,
        world: World,
        name: str | None = None,
        indexer: bool | None = None,
    ) -> None:
        # ``name`` (the cache entry) and ``indexer`` default to the stack's layer; the MTP layer states both
        name = name or f"layers.{layer_idx}.self_attn"
        super().__init__(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.q_lora_rank,
            cfg.kv_lora_rank,
            cfg.qk_nope_head_dim,
            0,
            cfg.v_head_dim,
            RotaryEmbedding(0, 0),  # no RoPE: the rotated part of q and k is empty
            name,
            dtype=dtype,
            scale=mla_softmax_scale(cfg.qk_nope_head_dim),
            norm_eps=cfg.rms_norm_eps,
            bias=cfg.attention_bias,
            world=world,
        )
        self.indexer = None
        if cfg.runs_indexer(layer_idx) if indexer is None else indexer:
            self.indexer = KPoolIndexer(
                cfg.hidden_size,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                cfg.index_topk,
                cfg.index_kpool,
                name + ".indexer",
                dtype=dtype,
            )

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """The latent entry and, with an indexer, its pooled keys and open-pool ring."""
        spec: dict[str, CacheSpec] = {self.cache_name: self.cache_spec()}
        if self.indexer is not None:
            spec.update(self.indexer.cache_spec())
        return spec

    def select_and_attend(
        self, x: torch.Tensor, batch: ForwardBatch, previous: Selection | DeviceSelection | None
    ) -> tuple[torch.Tensor, Selection | DeviceSelection | None]:
        """The attention output of this step's rows and the selection it used (this layer's indexer's, or
        ``previous`` on a ``shared`` layer), which the next layer may reuse."""
        query = self.prepare(x, batch)
        selection = previous if self.indexer is None else self.indexer(x, query.q_resid, batch)
        return self.attend(query, batch, selection), selection


def build_mixer(
    cfg: Glm5NextArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World
) -> KimiDeltaAttention | Glm5NextAttention:
    if not cfg.is_linear(layer_idx):
        return Glm5NextAttention(cfg, layer_idx, dtype=dtype, world=world)
    return KimiDeltaAttention(
        f"layers.{layer_idx}.self_attn",
        hidden_size=cfg.hidden_size,
        num_heads=cfg.linear_num_heads,
        head_dim=cfg.linear_head_dim,
        conv_kernel=cfg.linear_conv_kernel,
        lower_bound=cfg.linear_lower_bound,
        eps=cfg.rms_norm_eps,
        dtype=dtype,
        world=world,
    )


class Glm5NextDecoderLayer(nn.Module):
    """``layers.N``: mixer and MLP, each between a collapse and an expand of the residual streams; the sublayer
    outputs are all-reduced over TP before they are expanded."""

    def __init__(self, cfg: Glm5NextArchConfig, layer_idx: int, *, dtype: torch.dtype, world: World) -> None:
        super().__init__()
        self.world = world
        self.attn_hc = HyperConnection.from_config(cfg)
        self.ffn_hc = HyperConnection.from_config(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn: KimiDeltaAttention | Glm5NextAttention = build_mixer(
            cfg, layer_idx, dtype=dtype, world=world
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp: nn.Module = build_glm_moe(cfg, dtype=dtype, world=world, swiglu_limit=cfg.swiglu_limit)
        else:
            self.mlp = SwiGLUMLP(
                cfg.hidden_size,
                cfg.intermediate_size,
                dtype=dtype,
                world=world,
                swiglu_limit=cfg.swiglu_limit,
            )

    def forward(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        previous: Selection | DeviceSelection | None,
        group: Any = None,
    ) -> tuple[torch.Tensor, Selection | DeviceSelection | None]:
        x, post, comb = self.attn_hc.collapse(streams)
        if isinstance(self.self_attn, KimiDeltaAttention):
            out, selection = self.self_attn(self.input_layernorm(x), batch), None
        else:
            out, selection = self.self_attn.select_and_attend(self.input_layernorm(x), batch, previous)
        streams = self.attn_hc.expand(streams, all_reduce(out, self.world, group), post, comb)
        x, post, comb = self.ffn_hc.collapse(streams)
        out = all_reduce(self.mlp(self.post_attention_layernorm(x)), self.world, group)
        return self.ffn_hc.expand(streams, out, post, comb), selection


class StreamMean(nn.Module):
    """The final collapse of the streams: their unweighted mean (``[T, N, H] -> [T, H]``), in the streams' dtype."""

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.mean(dim=1)


class Glm5NextStack(nn.Module):
    """The text model: embedding, layers, the streams' mean, final norm."""

    def __init__(self, cfg: Glm5NextArchConfig, *, dtype: torch.dtype, world: World) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Glm5NextDecoderLayer(cfg, i, dtype=dtype, world=world) for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = StreamMean()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class Glm5NextForCausalLM(Model):
    """GLM-5.3-Flash's text model behind the engine's model contract. KDA layers hold per-request state, so
    ``info.hybrid`` is set (the prefix cache attaches where it holds a state snapshot); the open index pool's
    ring is state too. A decode-only step reads lengths from device tensors alone (KDA on the recurrent decode
    kernels, the indexer's decode step in ``dgpp_glm.glm5_next_indexer_decode``), so it can be captured in a
    CUDA graph (``engine.decode_graph``). The MTP layer the release ships is not part of this module."""

    def __init__(
        self,
        cfg: Glm5NextArchConfig,
        *,
        dtype: torch.dtype | None = None,
        world: World | None = None,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype or cfg.dtype
        self.world = world or World()
        self.group = group
        stack = Glm5NextStack(cfg, dtype=self.dtype, world=self.world)
        # module names are the checkpoint's: ``model.language_model.*`` in the multimodal wrapper, else ``model.*``
        self.nested = cfg.weight_prefix == "model.language_model."
        self.model: nn.Module = stack
        if self.nested:
            self.model = nn.Module()
            self.model.language_model = stack
            if cfg.vision is not None:
                self.model.visual = Glm5NextVisionTower(cfg.vision, dtype=self.dtype)
        tied = stack.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, dtype=self.dtype, tied_to=tied, world=self.world, group=group
        )
        self.info = causal_lm_info(cfg, self.dtype, hybrid=True, extra={"num_mtp_layers": cfg.num_mtp_layers})

    @property
    def stack(self) -> Glm5NextStack:
        """The text model, wherever the checkpoint's names put it."""
        stack = self.model.language_model if self.nested else self.model
        assert isinstance(stack, Glm5NextStack)
        return stack

    @property
    def visual(self) -> Glm5NextVisionTower | None:
        """The vision tower (``model.visual``) of a nested checkpoint with a ``vision_config``, else None."""
        tower = getattr(self.model, "visual", None) if self.nested else None
        assert tower is None or isinstance(tower, Glm5NextVisionTower)
        return tower

    def stream_mean(self, batch: ForwardBatch) -> torch.Tensor:
        """The streams' mean after the last layer, before the final norm, for every row of ``batch`` ``[T, hidden]``."""
        stack = self.stack
        hidden = stack.embed_tokens(batch.input_ids)
        visual = self.visual
        if visual is not None and batch.media is not None:
            hidden = merge_image_embeddings(hidden, batch, visual.encode)
        streams = to_streams(hidden, self.config.hc_mult)
        selection: Selection | DeviceSelection | None = None
        for layer in stack.layers:
            streams, selection = layer(streams, batch, selection, self.group)
        return stack.hc_head(streams)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        mean = self.stream_mean(batch)
        # the MTP layer drafts from the pre-final-norm mean (its ``hnorm`` is that input's norm), not the head's input
        self.keep_last_hidden(mean)
        return self.stack.norm(mean)[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def activation_bytes_per_token(self) -> int:
        """A prefill row of the widest MLP, plus the ``hc_mult`` residual streams a row carries between layers."""
        widest = max(self.config.intermediate_size, self.config.moe_intermediate_size)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        streams = 2 * self.config.hc_mult * self.config.hidden_size * itemsize
        return (
            transformer_activation_bytes(self.config.hidden_size, widest, self.world.size, itemsize) + streams
        )
