"""What the GLM plugin offers core besides its models (``dgpp_tiny_checkpoints`` / ``dgpp_bench_geometries``):
the tiny random ``glm4_moe``, ``glm_moe_dsa`` and ``glm5_next`` checkpoints and the GLM-5.3 and GLM-5.3-Flash
benchmark geometries."""

from __future__ import annotations

from dgpp.plugin_api import BenchGeometry, TinyCheckpoint
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe
from dgpp_glm.testing_glm5 import GLM5_BENCH, GLM5_LAYERS, build_tiny_glm_moe_dsa
from dgpp_glm.testing_glm5_next import (
    GLM5_NEXT_BENCH,
    GLM5_NEXT_LAYERS,
    TINY_GLM5_NEXT_BENCH,
    build_tiny_glm5_next,
)


def tiny_checkpoints() -> list[TinyCheckpoint]:
    return [
        TinyCheckpoint("glm4_moe", build_tiny_glm4_moe, "GLM-4.x MoE with its MTP layer"),
        TinyCheckpoint("glm_moe_dsa", build_tiny_glm_moe_dsa, "full GLM-5.3: MLA, DSA indexer, MoE"),
        TinyCheckpoint(
            "glm5_next",
            build_tiny_glm5_next,
            "GLM-5.3-Flash: KDA, NoPE MLA with the k-pooled indexer, mHC, MoE",
        ),
    ]


def bench_geometries() -> list[BenchGeometry]:
    return [
        BenchGeometry(f"glm-5.3-{GLM5_LAYERS}l", GLM5_BENCH, "GLM-5.3's first layers, int4/int8 packed"),
        BenchGeometry(
            f"glm-5.3-flash-{GLM5_NEXT_LAYERS}l",
            GLM5_NEXT_BENCH,
            "GLM-5.3-Flash's first layers (KDA, DSA, MoE)",
        ),
        BenchGeometry("tiny-glm-5.3-flash", TINY_GLM5_NEXT_BENCH, "its CPU smoke version"),
    ]
