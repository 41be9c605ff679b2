"""Qwen3.8-Flash-Next (``qwen4_exp``): the Qwen3.5-MoE hybrid's token mixers (Gated DeltaNet, gated full
attention) and MoE, rebuilt around a multi-stream residual.

- The residual is ``hc_count`` streams (``layers/gated_residual.py``): the embedding is copied into every
  stream; each block's input is a gated mix of the normalised streams and its output is injected back into
  each stream with its own weight. There are no pre-norms and no final norm: the last mixer
  (``hyper_connection_mixer``) feeds the LM head.
- Full-attention layers are QSA (``layers/qsa.py``): attention restricted to the blocks a small indexer picks.
- Layers named by ``ple_layer_ids`` first add a hashed n-gram embedding (PLE, ``layers/ngram.py``).

Cache entries: ``layers.{i}`` (GDN state, or QSA K/V), ``layers.{i}.indexer`` (QSA index keys, paged),
``layers.{i}.ple`` (n-gram context and PLE conv history, per request).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
from torch import nn

from dgpp.kernels._triton import triton_enabled
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from dgpp.nn.image_embeddings import merge_image_embeddings
from dgpp.nn.moe import RoutingConfig, SparseMoE
from dgpp.nn.parallel import all_reduce
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.plugin_api import CacheSpec, ForwardBatch, Model, ModelInfo, World
from dgpp_qwen.layers.attention import build_rotary
from dgpp_qwen.layers.gated_residual import GatedResidual
from dgpp_qwen.layers.ngram import PLELayer
from dgpp_qwen.layers.qsa import QSAttention
from dgpp_qwen.qwen4_exp_config import Qwen4ExpConfig
from dgpp_qwen.qwen4_exp_vision import Qwen4ExpVisionTower

LINEAR_ATTENTION = "linear_attention"


def layer_cache_name(index: int) -> str:
    return f"layers.{index}"


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """The GDN output norm with a sigmoid gate (``output_gate_type: sigmoid``) instead of SiLU."""

    sigmoid_gate = True


def build_moe(cfg: Qwen4ExpConfig, world: World) -> SparseMoE:
    moe, base = cfg.base.moe, cfg.base
    assert moe is not None, "qwen4_exp parses as the Qwen3.5-MoE hybrid: it always has experts"
    routing = RoutingConfig(
        num_experts=moe.num_experts, top_k=moe.top_k, scoring="softmax", renormalize=cfg.norm_topk_prob
    )
    return SparseMoE(
        base.hidden_size,
        moe.intermediate_size,
        routing,
        dtype=base.dtype,
        shared_intermediate_size=moe.shared_expert_intermediate_size,
        shared_gate=True,
        world=world,
    )


class Qwen4ExpDecoderLayer(nn.Module):
    """``[+PLE] -> GR mix -> GDN|QSA -> GR combine -> GR mix -> MoE -> GR combine`` over the hyper state."""

    def __init__(
        self,
        cfg: Qwen4ExpConfig,
        index: int,
        rotary: RotaryEmbedding,
        world: World,
        group: Any,
        *,
        cache_name: str | None = None,
    ) -> None:
        super().__init__()
        base = cfg.base
        self.world, self.group, self.dtype = world, group, base.dtype
        self.layer_type = base.layer_types[index]
        self.cache_name = cache_name or layer_cache_name(index)
        if self.layer_type == LINEAR_ATTENTION:
            gdn = base.linear_attn
            assert gdn is not None, "a linear_attention layer has the hybrid's GDN sizes"
            self.linear_attn = GatedDeltaNet(
                self.cache_name,
                hidden_size=base.hidden_size,
                num_k_heads=gdn.num_key_heads,
                num_v_heads=gdn.num_value_heads,
                head_k_dim=gdn.key_head_dim,
                head_v_dim=gdn.value_head_dim,
                conv_kernel=gdn.conv_kernel,
                eps=base.rms_norm_eps,
                dtype=base.dtype,
                world=world,
            )
            if cfg.gdn_output_gate == "sigmoid":
                self.linear_attn.norm = SigmoidGatedRMSNorm(
                    gdn.value_head_dim, base.rms_norm_eps, dtype=base.dtype
                )
        else:
            self.self_attn = QSAttention(cfg, self.cache_name, f"{self.cache_name}.indexer", rotary, world)
        self.mlp = build_moe(cfg, world)
        ngram = cfg.ngram
        self.ple = None
        if ngram is not None and index in ngram.layer_ids:
            self.ple = PLELayer(
                ngram,
                f"{self.cache_name}.ple",
                ngram.layer_ids.index(index),
                vocab_size=base.vocab_size,
                hidden_size=base.hidden_size,
                hc_count=cfg.hc_count,
                eps=base.rms_norm_eps,
                dtype=base.dtype,
            )
        gr = partial(
            GatedResidual,
            hidden_size=base.hidden_size,
            hc_count=cfg.hc_count,
            lowrank=cfg.hc_lowrank,
            eps=base.rms_norm_eps,
            dtype=base.dtype,
        )
        self.attn_hyper_connection = gr()
        self.mlp_hyper_connection = gr()

    def cache_entries(self, dtype: torch.dtype) -> dict[str, CacheSpec]:
        """The layer's entries (GDN state or QSA K/V and indexer keys, its PLE state), in the layer's own dtype
        (the model's and the drafter's ``cache_spec`` collect them)."""
        specs: dict[str, CacheSpec] = {}
        if self.layer_type == LINEAR_ATTENTION:
            specs[self.cache_name] = self.linear_attn.cache_spec()
        else:
            specs.update(self.self_attn.cache_specs(self.dtype))
        if self.ple is not None:
            specs[self.ple.name] = self.ple.cache_spec()
        return specs

    def forward(
        self,
        hyper: torch.Tensor,
        batch: ForwardBatch,
        normed: torch.Tensor | None = None,
        then: GatedResidual | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The hyper state after this layer, and (CUDA) its streams already normed by ``then``, the next gated
        residual site, in the launch that adds the MoE output. ``normed``: this layer's own input so normed."""
        if self.ple is not None:
            hyper, normed = self.ple(hyper, batch), None
        mixer = self.linear_attn if self.layer_type == LINEAR_ATTENTION else self.self_attn
        attn_gr, mlp_gr = self.attn_hyper_connection, self.mlp_hyper_connection
        x, logits = attn_gr.mix(hyper, normed)
        mixed = all_reduce(mixer(x, batch), self.world, self.group)
        hyper, normed = attn_gr.combine(hyper, mixed, logits, then=mlp_gr)
        x, logits = mlp_gr.mix(hyper, normed)
        return mlp_gr.combine(hyper, all_reduce(self.mlp(x), self.world, self.group), logits, then=then)


class Qwen4ExpTextStack(nn.Module):
    """``embed_tokens`` -> decoder layers -> ``hyper_connection_mixer`` (checkpoint prefix ``model.``)."""

    def __init__(self, cfg: Qwen4ExpConfig, world: World, group: Any) -> None:
        super().__init__()
        base = cfg.base
        rotary = build_rotary(base)
        self.embed_tokens = VocabEmbedding(base.vocab_size, base.hidden_size, dtype=base.dtype)
        self.layers = nn.ModuleList(
            Qwen4ExpDecoderLayer(cfg, i, rotary, world, group) for i in range(base.num_layers)
        )
        self.hyper_connection_mixer = GatedResidual(
            base.hidden_size,
            cfg.hc_count,
            cfg.hc_lowrank,
            base.rms_norm_eps,
            dtype=base.dtype,
            use_combine=False,
        )


class Qwen4ExpForCausalLM(Model):
    """Qwen3.8-Flash-Next: the text model, and the vision tower (``visual``) when the checkpoint has one (the MTP
    layer is ``draft.py``'s). Image placeholder rows take the tower's output instead of the token embedding.

    With ``keep_hidden`` on, ``last_hidden`` keeps every row's mixed hidden state of the last forward (the MTP
    layer's input)."""

    @property
    def decode_graph_safe(self) -> bool:  # type: ignore[override]
        """With Triton a decode step reads no host value: QSA selects and attends per row on the device
        (``layers/qsa_rows.py``), GDN, PLE and the gated residuals read none. ``DGPP_KERNELS=torch`` keeps QSA's
        masked torch form, which sizes its masks by host-side lengths: that decodes eager."""
        return triton_enabled()

    def __init__(
        self,
        cfg: Qwen4ExpConfig,
        world: World | None = None,
        group: Any = None,
        *,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # ``dtype``: a deployment's compute dtype
        cfg = dataclasses.replace(cfg, base=dataclasses.replace(cfg.base, dtype=dtype or cfg.base.dtype))
        world = world or World()
        base = cfg.base
        self.cfg, self.world, self.group = cfg, world, group
        self.model = Qwen4ExpTextStack(cfg, world, group)
        self.visual = Qwen4ExpVisionTower(cfg.vision, dtype=base.dtype) if cfg.vision else None
        tied = self.model.embed_tokens if base.tie_word_embeddings else None
        self.lm_head = LMHead(
            base.vocab_size, base.hidden_size, dtype=base.dtype, tied_to=tied, world=world, group=group
        )
        self.last_hidden: torch.Tensor | None = None
        self.info = ModelInfo(
            vocab_size=base.vocab_size,
            max_position=base.max_position,
            eos_token_ids=base.eos_token_ids,
            bos_token_id=base.bos_token_id,
            dtype=base.dtype,
            hybrid=True,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model.embed_tokens(batch.input_ids)
        if self.visual is not None and batch.media is not None:
            hidden = merge_image_embeddings(hidden, batch, self.visual.encode)
        hyper = hidden.repeat(1, self.cfg.hc_count)  # every stream starts as the embedding
        layers, final = self.model.layers, self.model.hyper_connection_mixer
        normed = None
        for i, layer in enumerate(layers):
            following = layers[i + 1] if i + 1 < len(layers) else None
            # the next site's norm joins this layer's last injection, unless PLE changes the streams between
            then = final if following is None else None if following.ple else following.attn_hyper_connection
            hyper, normed = layer(hyper, batch, normed, then)
        hidden = final.mix_only(hyper, normed)
        self.keep_last_hidden(hidden)
        return hidden[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
