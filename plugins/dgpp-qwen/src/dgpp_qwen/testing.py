"""What the Qwen plugin offers core besides its models (``dgpp_tiny_checkpoints`` / ``dgpp_bench_geometries``):
the tiny random checkpoints of every Qwen architecture, the demo's chat-ready ``qwen3-chat``, and the published
Qwen geometries for ``dgpp bench``."""

from __future__ import annotations

from functools import partial

from dgpp.plugin_api import BenchGeometry, PackedRelease, TinyCheckpoint
from dgpp.testing.builders import build_transformers_checkpoint
from dgpp_qwen.testing_qwen3 import GEOMETRIES, KINDS, build_qwen3_chat
from dgpp_qwen.testing_qwen4_exp import (
    QWEN4_EXP_BENCH,
    QWEN4_EXP_LAYERS,
    TINY_QWEN4_EXP_BENCH,
    build_tiny_qwen4_exp,
)


def tiny_checkpoints() -> list[TinyCheckpoint]:
    kinds = [
        TinyCheckpoint(
            kind,
            partial(build_transformers_checkpoint, config_cls, model_cls, text=extra, vision=vision),
            f"transformers' {model_cls}",
        )
        for kind, (config_cls, model_cls, extra, vision) in KINDS.items()
    ]
    return [
        *kinds,
        TinyCheckpoint(
            "qwen3-chat", build_qwen3_chat, "Qwen3 with a byte-level chat tokenizer (the CPU demo)"
        ),
        TinyCheckpoint("qwen4_exp", build_tiny_qwen4_exp, "Qwen3.8-Flash-Next: GDN + PLE, QSA, streams, MoE"),
    ]


# The Qwen3.5-MoE NVFP4 release (nvidia/Qwen3.5-122B-A10B-NVFP4) packs the routed experts only: attention,
# Gated DeltaNet, the shared expert and its gate stay BF16 (its ModelOpt exclude_modules)
_BF16_IN_NVFP4 = ("*self_attn*", "*linear_attn*", "*shared_expert*", "*mlp.gate")
QWEN3_5_MOE_RELEASE = PackedRelease(
    keep_dense=_BF16_IN_NVFP4,
    quantization_config={
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": ["lm_head", *_BF16_IN_NVFP4],
    },
)


def bench_geometries() -> list[BenchGeometry]:
    return [
        *(
            BenchGeometry(name, config, release=_release(config["model_type"]))
            for name, config in GEOMETRIES.items()
        ),
        BenchGeometry(
            f"qwen3.8-flash-next-{QWEN4_EXP_LAYERS}l",
            QWEN4_EXP_BENCH,
            "Qwen3.8-Flash-Next's first layers (GDN + PLE, QSA, MoE), the n-gram table scaled down",
        ),
        BenchGeometry("tiny-qwen3.8-flash-next", TINY_QWEN4_EXP_BENCH, "its CPU smoke version"),
    ]


def _release(model_type: str) -> PackedRelease:
    return QWEN3_5_MOE_RELEASE if model_type == "qwen3_5_moe_text" else PackedRelease()
