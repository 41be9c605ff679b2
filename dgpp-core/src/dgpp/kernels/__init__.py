"""Triton kernels, each beside its torch reference (``<op>_ref``) in ``dgpp/kernels/<op>.py``.

The names exported here dispatch: Triton for CUDA tensors, the torch reference elsewhere
(``DGPP_KERNELS=torch`` forces the references on a GPU, for A/B checks). Layers in ``dgpp.nn``
call them on their CUDA path only, importing lazily so CPU installs never load Triton. (Dispatchers
are named apart from their modules, so ``dgpp.kernels.rotary`` stays the module.)
"""

from __future__ import annotations

from dgpp.kernels.gated_delta import gated_delta_rule
from dgpp.kernels.gated_rmsnorm import gated_rms_norm
from dgpp.kernels.gdn_gates import gdn_gates
from dgpp.kernels.gemv import gate_up_silu, gemv_applies, multi_linear
from dgpp.kernels.kv_write import write_kv
from dgpp.kernels.moe import fused_moe
from dgpp.kernels.output_gate import shared_expert_add, sigmoid_gate
from dgpp.kernels.paged_attention import paged_decode_attention
from dgpp.kernels.prefill_attention import paged_prefill_attention
from dgpp.kernels.qk_norm_rope import fused_qk_norm_rope
from dgpp.kernels.quantized_write import write_quantized
from dgpp.kernels.rmsnorm import rms_norm
from dgpp.kernels.rotary import apply_rotary
from dgpp.kernels.router_topk import router_topk
from dgpp.kernels.sampling import greedy_tokens, sample_tokens
from dgpp.kernels.swiglu import silu_and_mul, silu_mul_pair

__all__ = [
    "apply_rotary",
    "fused_moe",
    "fused_qk_norm_rope",
    "gate_up_silu",
    "gated_delta_rule",
    "gated_rms_norm",
    "gdn_gates",
    "gemv_applies",
    "greedy_tokens",
    "multi_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "router_topk",
    "sample_tokens",
    "shared_expert_add",
    "sigmoid_gate",
    "silu_and_mul",
    "silu_mul_pair",
    "write_kv",
    "write_quantized",
]
