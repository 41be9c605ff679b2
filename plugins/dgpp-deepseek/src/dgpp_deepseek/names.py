"""Module-side parameter names of ``DeepseekV4ForCausalLM`` -> the release's tensor names.

The model's modules already carry the release's names (``embed``, ``layers.N.attn.wq_a``, ``attn.compressor.wkv``,
``attn.indexer.compressor.ape``, ``attn_norm``, ``ffn.gate``, ``head``, ...); what differs is where core layers
name a parameter their own way: the hyper-connections (``attn_hc.fn`` is ``hc_attn_fn``, ``hc_head.hc_fn`` is
``hc_head_fn``), the router's correction bias (``gate.bias``) and the experts' SwiGLU projections (``w1`` gate,
``w3`` up, ``w2`` down, the shared expert under ``shared_experts``).
"""

from __future__ import annotations

import re

_RULES = (
    (re.compile(r"\.(attn|ffn)_hc\.(fn|base|scale)$"), r".hc_\1_\2"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"\.gate\.e_score_correction_bias$"), ".gate.bias"),
    (re.compile(r"\.shared_expert\."), ".shared_experts."),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.gate_proj\."), r".\1.w1."),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.up_proj\."), r".\1.w3."),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.down_proj\."), r".\1.w2."),
)


def release_name(name: str) -> str:
    for pattern, repl in _RULES:
        name = pattern.sub(repl, name)
    return name
