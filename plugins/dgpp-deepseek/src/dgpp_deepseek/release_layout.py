"""The DeepSeek-V4 release's quantized layout, as the loader and the memory plan resolve it.

The release (``deepseek-ai/DeepSeek-V4-Flash-0731``) ships, per its ``quantization_config``
(``quant_method: fp8``, ``fmt: e4m3``, ``scale_fmt: ue8m0``, ``weight_block_size: [128, 128]``) and its
``expert_dtype: fp4``:

- routed experts (main layers and the MTP blocks) in MXFP4: ``w1/w2/w3.weight`` I8 ``[N, K/2]`` (two E2M1
  codes per byte, the even column in the low nibble) and ``.scale`` E8M0 ``[N, K/32]``;
- the attention projections, the indexer's query projection and the shared expert in FP8 E4M3 with an E8M0
  ``.scale`` per 128 x 128 block (a ceil grid: partial edge blocks);
- BF16 for the embedding, the head, the router, the compressors' ``wkv`` / ``wgate`` (also the indexer's
  compressor) and the indexer's ``weights_proj``; fp32 for norms, sinks, ``ape``, the hyper-connection
  parameters and the correction bias; I64 for ``tid2eid``.

Every scale is named ``<module>.scale``, where core's formats call it ``weight_scale_inv`` (FP8 block) and
``weight_scale`` (MXFP4): ``scale_tensor_name`` maps one to the other. Which modules are stored dense is
read from the checkpoint itself when it is at hand (a ``.weight`` with no ``.scale`` beside it), else taken
from the list above (``RELEASE_DENSE``: the memory plan, which reads no tensor).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import Any

from dgpp.plugin_api import ConfigError, LoadContext, checkpoint_tensor_names

KEY = "quantization_config"
# the modules the release stores in BF16 though its quantization_config covers every Linear
RELEASE_DENSE = (
    r"(.*\.)?ffn\.gate",
    r"(.*\.)?attn\.(indexer\.)?compressor\.(wkv|wgate)",
    r"(.*\.)?attn\.indexer\.weights_proj",
    r"(.*\.)?attn\.indexer\.wk",  # DeepSeek-V4.1's index-key projection
    r"mtp\.\d+\.(markov_head\.markov_w[12]|confidence_head\.proj)",  # the DSpark heads
    r"head",
)
# the release's quantization_config (``expert_dtype`` sits at the top level of its config.json)
RELEASE_QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
    "expert_dtype": "fp4",
}
_CORE_SCALE = re.compile(r"\.(weight_scale_inv|weight_scale)$")


def scale_tensor_name(name: str) -> str:
    """A packed module's scale as core names it (``X.weight_scale_inv`` / ``X.weight_scale``) -> the
    release's ``X.scale``; every other name as is."""
    return _CORE_SCALE.sub(".scale", name)


def dense_modules(tensor_names: Iterable[str]) -> list[str]:
    """The modules a checkpoint stores dense: a 2-D ``.weight`` owner with no ``.scale`` beside it."""
    names = set(tensor_names)
    return sorted(
        n[: -len(".weight")]
        for n in names
        if n.endswith(".weight") and n[: -len(".weight")] + ".scale" not in names
    )


def dense_entry(patterns: Iterable[str]) -> str:
    """One anchored ``re:`` alternation of module-name regexes (a ``modules_to_not_convert`` entry the resolver
    tries once per module)."""
    return "re:^(" + "|".join(patterns) + ")$"


def release_hf_config(hf_config: dict[str, Any], tensor_names: Iterable[str] | None = None) -> dict[str, Any]:
    """``hf_config`` with its ``quantization_config`` leaving dense what the release stores dense: the modules
    of ``tensor_names`` without a ``.scale`` (the checkpoint's own word), or ``RELEASE_DENSE`` without names.
    A checkpoint with no ``quantization_config`` (a dense one) is returned as is."""
    qc = hf_config.get(KEY)
    if qc is None:
        return hf_config
    if not isinstance(qc, dict):
        raise ConfigError(f"{KEY}: expected an object, got {type(qc).__name__}")
    if tensor_names is None:
        patterns = list(RELEASE_DENSE)
    else:
        patterns = [re.escape(m) for m in dense_modules(tensor_names)]
    ignore = list(qc.get("modules_to_not_convert") or [])
    if patterns:
        ignore.append(dense_entry(patterns))
    return {**hf_config, KEY: {**qc, "modules_to_not_convert": ignore}}


def release_context(ctx: LoadContext) -> LoadContext:
    """``ctx`` with the ``quantization_config`` the loader resolves: what the checkpoint stores dense stays dense."""
    names = checkpoint_tensor_names(ctx.checkpoint_dir)
    return dataclasses.replace(ctx, hf_config=release_hf_config(ctx.hf_config, names))


_STAGE_HEAD = re.compile(r"\.hc_head\.hc_(fn|base|scale)$")


def release_tensor_name(structural: Callable[[str], str]) -> Callable[[str], str]:
    """A module-side parameter name -> the release's: ``structural`` (the family's module renames), a draft
    stage's head (``mtp.<s>.hc_head.hc_fn`` is ``mtp.<s>.hc_head_fn``), then the scale suffix
    (``scale_tensor_name``)."""
    return lambda name: scale_tensor_name(_STAGE_HEAD.sub(r".hc_head_\1", structural(name)))
