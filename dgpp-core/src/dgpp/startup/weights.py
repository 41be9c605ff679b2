"""Filling a family's freshly built modules from its checkpoint: the one load pipeline every family runs.

build on the load device -> give the modules the checkpoint stores quantized their packed form
(``quantize_modules``) -> fill every parameter (``load_weights``, one read per tensor, this rank's slice)
-> the family's own checks on the open checkpoint -> close it -> each module's own settled form of what it loaded
(``settle_weights``) -> the engine's explicit load-time conversions (``convert_dense_weights``:
``engine.dense_weights`` / ``engine.bf16_weights``; ``pack_gguf_weights``: ``engine.gguf_weights``) -> eval mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from dgpp.checkpoint import CheckpointReader, load_weights
from dgpp.checkpoint.gguf_packed import pack_gguf_weights
from dgpp.family import LoadContext
from dgpp.quant.apply import convert_dense_weights, quantize_modules
from dgpp.quant.scheme import QuantScheme

M = TypeVar("M", bound=nn.Module)


def same_name(name: str) -> str:
    """The checkpoint names a tensor as the module does."""
    return name


def load_family_weights(
    ctx: LoadContext,
    build: Callable[[], M],
    rename: Callable[[str], str] = same_name,
    *,
    packed: bool = True,
    convert: bool = True,
    after_load: Callable[[M, CheckpointReader], None] | None = None,
    reader: CheckpointReader | None = None,
    scheme: QuantScheme | None = None,
) -> M:
    """``build()`` on ``ctx.device``, filled from ``ctx.checkpoint_dir`` and in eval mode.

    ``rename`` maps a module-side parameter name to the checkpoint's. ``packed=False``: the tensors are stored
    dense whatever ``quantization_config`` says (no packed parameters are made). ``convert=False`` skips the
    engine's load-time conversions (a drafter that shares the main model's head). ``after_load(module,
    reader)`` reads what ``load_weights`` does not (tables, checks against constants) while the checkpoint is
    open. ``reader`` (closed here) presents the checkpoint under the module's names where a release stores
    tensors its own way (e.g. fused, pre-sharded projections), and ``scheme`` says which format each module is
    in where the release's ``quantization_config`` cannot (see ``quantize_modules``).
    """
    reader = reader if reader is not None else CheckpointReader(ctx.checkpoint_dir)
    try:
        # parameters, packed ones included, are made on the load device
        with torch.device(ctx.device or "cpu"):
            module = build()
            if packed:
                quantize_modules(module, ctx.hf_config, rename=rename, scheme=scheme)
        load_weights(module, reader, rename=rename)
        if after_load is not None:
            after_load(module, reader)
    finally:
        reader.close()
    settle_weights(module)
    if convert:
        convert_dense_weights(module, ctx.engine)
        pack_gguf_weights(module, ctx.checkpoint_dir, ctx.engine, rename)
    return module.eval()


def settle_weights(module: nn.Module) -> nn.Module:
    """Call ``settle_weights()`` on every submodule that defines one, once its weights are in: a layer may keep a
    form of its tensors that its forward reads faster, with the same bits (e.g. MLA keeps a packed ``kv_b_proj``
    decoded, ``dgpp.nn.mla``). Memory plans built on ``meta`` call it after ``quantize_modules`` so they count that
    form; random-weight builds (``dgpp bench``) call it after filling."""
    for sub in list(module.modules()):
        if callable(getattr(type(sub), "settle_weights", None)):
            sub.settle_weights()
    return module


def checkpoint_tensor_names(checkpoint_dir: Path) -> list[str]:
    """Every tensor name the checkpoint stores (all shards), e.g. to find which optional parts it ships."""
    reader = CheckpointReader(checkpoint_dir)
    try:
        return list(reader.names())
    finally:
        reader.close()
