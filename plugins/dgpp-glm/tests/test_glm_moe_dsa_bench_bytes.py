"""``dgpp bench`` bytes/step of a GLM-5.3 (glm_moe_dsa) decode step under each ``engine.kv_dtype``, on the tiny fp32
model (4 MLA layers with 32-wide latents and 8-wide rotated keys, DSA indexers of 16-wide keys on layers 0 and 2,
index_topk 8): each layer reads the latent rows it attends (all up to index_topk, then its selection), each indexer
layer every cached key once past index_topk, rows as stored; and the bench's decode session stores and reads the
quantized latents."""

from __future__ import annotations

import pytest
import torch

from dgpp.bench.decode import DecodeSession, run_case
from dgpp.bench.models import random_model_from_config
from dgpp.bench.step_bytes import decode_step_bytes
from dgpp.step.cache_spec import KV_FP8
from dgpp_glm.testing_glm5 import tiny_glm_moe_dsa_config

FP32, SCALE = 4, 4
LAYERS, INDEXERS, LATENT, ROPE, INDEX_DIM, TOPK = 4, 2, 32, 8, 16, 8
# per format: (latent row bytes, index key row bytes); fp8 / fp4 rows carry one fp32 scale, k_rot stays fp32
ROW_BYTES = {
    "auto": ((LATENT + ROPE) * FP32, INDEX_DIM * FP32),
    "fp8": (LATENT + ROPE * FP32 + SCALE, INDEX_DIM + SCALE),
    # fp4: 16 bytes of e2m1 codes and 2 e4m3 block scales, padded to 16 bytes
    "fp4": (32 + ROPE * FP32 + SCALE, INDEX_DIM + SCALE),
}


@pytest.fixture(scope="module")
def model():
    raw = {
        **tiny_glm_moe_dsa_config(),
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "torch_dtype": "float32",
    }
    assert (raw["num_hidden_layers"], raw["kv_lora_rank"], raw["qk_rope_head_dim"]) == (LAYERS, LATENT, ROPE)
    assert (raw["index_head_dim"], raw["index_topk"]) == (INDEX_DIM, TOPK)
    return random_model_from_config(raw, "cpu", seed=2)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp4"])
def test_step_bytes_read_the_selected_latents_and_every_index_key(model, kv_dtype):
    latent, key = ROW_BYTES[kv_dtype]
    weights = decode_step_bytes(model, 3, 0.0, kv_dtype=kv_dtype)
    for context in (5.0, 8.0, 9.0, 40.0):
        attended = min(context, TOPK)
        keys = context if context > TOPK else 0.0  # the indexer scores nothing while it keeps every token
        want = 3 * (LAYERS * attended * latent + INDEXERS * keys * key)
        assert decode_step_bytes(model, 3, context, kv_dtype=kv_dtype) - weights == want


def test_the_bench_session_stores_and_reads_quantized_latents(model):
    session = DecodeSession(model, 2, 24, 4, graph=False, kv_dtype="fp4")
    latent, k_rot = session.pools.kv["layers.0.self_attn"]
    assert latent.dtype == torch.uint8 and latent.shape[-1] == 32 and k_rot.dtype == torch.float32
    assert session.pools.kv["layers.0.self_attn.indexer"][0].dtype == KV_FP8
    # past index_topk: sparse rows over fp4 latents, graph path (uncaptured on CPU) against eager
    graph, eager = (run_case(model, 12, 2, 4, graph=g, copy_gbs=1.0, kv_dtype="fp4") for g in (True, False))
    assert graph.tokens == eager.tokens
    mean_context = 12 + 1 + (3 - 1) / 2  # 3 timed steps
    want = decode_step_bytes(model, 2, mean_context, graph.experts_read, kv_dtype="fp4")
    assert graph.step_bytes == want
