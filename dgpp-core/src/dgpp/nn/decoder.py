"""The skeleton of a pre-norm decoder-only language model: ``embed -> blocks -> final norm -> head``.

Families whose blocks are plain pre-norm residuals (Flint, MiMo, GLM-4.x) build each block's norms, attention and MLP
and hand them to ``PreNormBlock``; ``PreNormCausalLM`` holds the stack and the head behind the engine's model
contract. Attribute names are the checkpoints' (``model.embed_tokens``, ``model.layers.N.input_layernorm``,
``...self_attn``, ``...post_attention_layernorm``, ``...mlp``, ``model.norm``, ``lm_head``), so weights load by
name with no renaming.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from dgpp.family import World
from dgpp.nn.embedding import LMHead, VocabEmbedding
from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.norm import add_rms_norm
from dgpp.nn.parallel import all_reduce
from dgpp.step.batch import ForwardBatch
from dgpp.step.memory import transformer_activation_bytes
from dgpp.step.model import Model, ModelInfo


class DecoderLMConfig(Protocol):
    """What the skeleton reads from a family's typed config (read-only, so a frozen dataclass satisfies it)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    @property
    def bos_token_id(self) -> int | None: ...


def causal_lm_info(
    cfg: DecoderLMConfig, dtype: torch.dtype, *, hybrid: bool = False, extra: dict[str, Any] | None = None
) -> ModelInfo:
    """The ``ModelInfo`` of a causal LM built from ``cfg`` in ``dtype``: its vocabulary, position limit and
    special tokens as the config states them. ``hybrid``: some layer holds per-request state; ``extra``: the
    family's own facts."""
    return ModelInfo(
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position_embeddings,
        eos_token_ids=cfg.eos_token_ids,
        bos_token_id=cfg.bos_token_id,
        dtype=dtype,
        hybrid=hybrid,
        extra=extra or {},
    )


class DenseOrMoEConfig(Protocol):
    """What ``dense_or_moe`` reads from a family's typed config (read-only)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...

    def is_moe_layer(self, layer_idx: int) -> bool: ...


def dense_or_moe(
    cfg: DenseOrMoEConfig, layer_idx: int, moe: Callable[[], nn.Module], *, dtype: torch.dtype, world: World
) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the family's ``moe()`` where ``cfg.is_moe_layer`` says so, else the dense SwiGLU
    of ``intermediate_size``."""
    if cfg.is_moe_layer(layer_idx):
        return moe()
    return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, world=world)


class PreNormBlock(nn.Module):
    """``h = x + attn(input_layernorm(x))``; ``out = h + mlp(post_attention_layernorm(h))``, each sublayer's
    output summed over the tensor-parallel ranks. ``self_attn(x, batch)`` and ``mlp(x)`` are the family's.

    ``sublayers`` is the block without its first norm and last add, so a stack of blocks adds each block's
    output to the stream in the next block's norm (``add_rms_norm``: one kernel on CUDA), as ``forward`` does
    within the block."""

    def __init__(
        self,
        input_layernorm: nn.Module,
        self_attn: nn.Module,
        post_attention_layernorm: nn.Module,
        mlp: nn.Module,
        world: World,
    ) -> None:
        super().__init__()
        self.world = world
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp

    def forward(self, x: torch.Tensor, batch: ForwardBatch, group=None) -> torch.Tensor:
        out, h = self.sublayers(self.input_layernorm(x), x, batch, group)
        return h + out

    def sublayers(
        self, normed: torch.Tensor, residual: torch.Tensor, batch: ForwardBatch, group=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, stream after the attention's add)`` from the block's normed input and the stream
        before it; the block's output is their sum."""
        attn = all_reduce(self.self_attn(normed, batch), self.world, group)
        x, residual = add_rms_norm(attn, residual, self.post_attention_layernorm)
        return all_reduce(self.mlp(x), self.world, group), residual


def stream_blocks(
    x: torch.Tensor,
    layers: Sequence[nn.Module],
    final_norm: nn.Module,
    sublayers: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    keep: Collection[int] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``final_norm`` of the stream ``x`` after pre-norm ``layers``, and the stream after each layer in ``keep``.

    ``sublayers(layer, normed, stream)`` runs a layer without its first norm and last add: it returns its output
    and the stream before that output. The output is added to the stream in the next layer's ``input_layernorm``
    (``add_rms_norm``: one kernel on CUDA; the final norm after the last layer), so no layer adds its own. A kept
    layer's stream costs one add."""
    normed, stream = layers[0].input_layernorm(x), x
    kept: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        out, stream = sublayers(layer, normed, stream)
        if i in keep:
            kept[i] = stream + out
        norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
        normed, stream = add_rms_norm(out, stream, norm)
    return normed, kept


def streams_residual(layer: nn.Module) -> bool:
    """True for a ``PreNormBlock`` whose ``forward`` is the plain block's, so a stack may run its
    ``sublayers`` and fuse each add into the next norm."""
    return isinstance(layer, PreNormBlock) and type(layer).forward is PreNormBlock.forward


class DecoderStack(nn.Module):
    """``model.*`` of the checkpoint: embedding, the decoder blocks, the final norm."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        layers: Iterable[nn.Module],
        norm: nn.Module,
        *,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size, hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


C = TypeVar("C", bound=DecoderLMConfig)


class PreNormCausalLM(Model, Generic[C]):
    """A ``DecoderStack`` and its head behind the model contract. ``forward`` keeps the post-final-norm hidden
    of every row when ``keep_hidden`` is on. ``hybrid``: some layer holds per-request state (a window ring, a
    recurrent state), so the prefix cache attaches only where it holds a state snapshot. ``extra``: the family's
    own facts for ``ModelInfo.extra`` (GLM: its MTP layer count). ``C``: the family's config class, which
    ``self.config`` is typed as."""

    def __init__(
        self,
        cfg: C,
        stack: DecoderStack,
        *,
        dtype: torch.dtype,
        world: World,
        group: Any = None,
        hybrid: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.world = world
        self.group = group
        self.model = stack
        tied = stack.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, tied_to=tied, world=world, group=group
        )
        self.info = causal_lm_info(cfg, dtype, hybrid=hybrid, extra=extra)

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """Post-final-norm hidden of every row of ``batch`` ``[T, hidden]``. Plain pre-norm blocks hand the
        stream on unsummed: each block's output is added in the next norm (the final norm after the last)."""
        x = self.model.embed_tokens(batch.input_ids)
        layers = list(self.model.layers)
        if not all(streams_residual(layer) for layer in layers):
            for layer in layers:
                x = layer(x, batch, self.group)
            return self.model.norm(x)
        return stream_blocks(
            x, layers, self.model.norm, lambda layer, h, r: layer.sublayers(h, r, batch, self.group)
        )[0]

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.hidden_states(batch)
        self.keep_last_hidden(hidden)
        return hidden[batch.logits_indices]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def activation_bytes_per_token(self) -> int:
        """A pre-norm block's prefill row (``transformer_activation_bytes``) with the widest MLP any layer
        declares (its ``prefill_width``)."""
        widest = max((getattr(m, "prefill_width", 0) for m in self.model.layers.modules()), default=0)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return transformer_activation_bytes(self.config.hidden_size, widest, self.world.size, itemsize)
