"""DeepSeek-V4.1-Flash benchmark geometries, built straight in the release's packed formats.

A release layer holds 384 routed experts of 3 x 5120 x 2304: 27 GB in BF16, 7.2 GB as the MXFP4 the release ships.
So the geometry is never drawn dense: the model is built on the host (its constructor's dense expert stacks are
never touched, so they cost no memory), the release's quantization swaps in packed parameters allocated on the
device (MXFP4 routed experts, FP8 E4M3 with E8M0 scales on 32 x 32 blocks for attention, the shared expert and
Engram's projection, BF16 where the release stores it dense: embedding, head, router, compressors, index keys),
and ``dgpp.bench.packed_random`` draws codes and scales in place. Engram's tables get random FP8 rows in the
release's layout, resident in host memory as ``engine.ngram_table: resident`` holds them, sized for a
benchmark (``engram_vocab_size`` 262,144: 24 buckets of about 262K rows, 1.7 GB a layer, where the release's
16M-row buckets make 101 GB a layer); tokens map to Engram classes as ``id mod engram_compressed_vocab_size``
(the geometry has no tokenizer).

``deepseek-v4.1-flash-8l``: the release's per-layer shape and 8 of its 40 layers with every role the 40 keep --
window-only layers (0, 1), two ratio-2 groups (kv and index sources 2 and 3, layer 4 sharing 3's entries and
selection), the ratio-1 decoder (layer 5 the kv, index and candidate source, 6 sharing, 7 re-indexing inside the
candidate pool), Engram on layers 1 and 3, 4 hyper-connection streams. ``tiny-deepseek-v41`` is the same roles at
tiny widths for the CPU.

``python -m dgpp_deepseek.v41_bench`` prints the 8-layer geometry's bytes per part, built on ``meta``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dgpp.plugin_api import BenchGeometry, LoadContext, Model, quantize_modules
from dgpp_deepseek.release_layout import release_hf_config
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig
from dgpp_deepseek.v41_release import RELEASE_QUANTIZATION, RELEASE_TEXT_SHAPE

V41_FLASH_LAYERS = 8
# the release's roles over 8 layers (the 40 have ratios [0] * 2 + [2] * 18 + [1] * 20, kv sources 2/8/14/20,
# index sources 2/8/14/20/24/28/32/36, candidate source 20, Engram on 1 and 14)
_ROLES: dict[str, Any] = {
    "num_hidden_layers": V41_FLASH_LAYERS,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [2, 3, 5],
    "index_source_layer_ids": [2, 3, 5, 7],
    "candidate_source_layer_id": 5,
    "engram_layer_ids": [1, 3],
}
V41_FLASH_TEXT: dict[str, Any] = {
    **RELEASE_TEXT_SHAPE,
    **_ROLES,
    "engram_vocab_size": 262_144,  # the release's is 16,000,000 (101 GB a layer)
    "num_nextn_predict_layers": 0,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# the CPU twin: the same roles, widths a CPU decodes in seconds, window / top-k / candidates below its prompts
TINY_V41_TEXT: dict[str, Any] = {
    **V41_FLASH_TEXT,
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 6,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 37,
    "engram_compressed_vocab_size": 64,
    "max_position_embeddings": 512,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "initializer_range": 0.08,
}


def root_config(text: dict[str, Any]) -> dict[str, Any]:
    """The release's root config.json around ``text`` (its quantization, ``text_config`` nested), with every
    Engram layer's row count filled in from its buckets."""
    from dgpp_deepseek.v41_engram import bucket_primes

    text = {**text, "engram_num_embeddings": [0] * len(text["engram_layer_ids"])}
    root = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41",
        "text_config": text,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "quantization_config": RELEASE_QUANTIZATION,
    }
    primes = bucket_primes(DeepseekV41ArchConfig.from_hf_config(root))
    text["engram_num_embeddings"] = [sum(sum(p) for p in layer) for layer in primes]
    return root


def packed_model(raw: dict[str, Any], device: str) -> Model:
    """The model for ``raw`` with the release's packed parameters allocated on ``device``, nothing drawn."""
    from dgpp_deepseek.v41_loader import build_model, checkpoint_name

    cfg = DeepseekV41ArchConfig.from_hf_config(raw)
    ctx = LoadContext(Path(), raw, "deepseek", "DeepseekV41ForCausalLM", device=device)
    # on the host (meta stays meta): the dense expert stacks the constructor makes are never touched, so they
    # take no memory before the packed ones replace them
    with torch.device("meta" if device == "meta" else "cpu"):
        model = build_model(cfg, ctx)
    with torch.device(device):
        quantize_modules(model, release_hf_config(raw), rename=checkpoint_name)
    target = torch.device(device).type  # "cuda" places on cuda:0, which equals no bare "cuda"
    for param in model.parameters():
        if param.device.type != target:
            param.data = torch.empty_like(param, device=device)
    return model.to(device)  # the buffers (rotary frequencies)


def attach_bench_engram(model: Model, cfg: DeepseekV41ArchConfig, seed: int) -> None:
    """Every Engram layer gets a random table in the release's row layout (E4M3 codes, an E8M0 scale per 32),
    resident in host memory, and token classes ``id mod engram_compressed_vocab_size``."""
    from dgpp_deepseek.v41_engram import EngramTable, EngramV41, bucket_primes

    primes = bucket_primes(cfg)
    classes = [i % cfg.engram_compressed_vocab_size for i in range(cfg.vocab_size)]
    gen = torch.Generator().manual_seed(seed)
    blocks = cfg.engram_head_dim // 32
    for engram in (m for m in model.modules() if isinstance(m, EngramV41)):
        rows = cfg.engram_num_embeddings[engram.position]
        codes = torch.empty(rows, cfg.engram_head_dim, dtype=torch.uint8)
        for start in range(0, rows, 1 << 20):  # unit-spread rows: N(0, 16) codes at scale 2^-4
            part = codes[start : start + (1 << 20)]
            drawn = (torch.randn(part.shape, generator=gen) * 16).clamp(-448, 448)
            part.copy_(drawn.to(torch.float8_e4m3fn).view(torch.uint8))
        scales = np.full((rows, blocks), 127 - 4, dtype=np.uint8)
        table = EngramTable.resident(codes.numpy(), scales)
        engram.attach(table, classes, cfg.engram_pad_token_id, primes[engram.position], engram.layer_idx)


@torch.inference_mode()
def build_packed_v41(raw: dict[str, Any], device: str, seed: int = 0) -> Model:
    """A random DeepSeek-V4.1 model in the release's packed formats on ``device`` (``BenchGeometry.build``)."""
    from dgpp.plugin_api import fill_random, settle_weights

    cfg = DeepseekV41ArchConfig.from_hf_config(raw)
    model = packed_model(raw, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_random(model, float(raw["text_config"].get("initializer_range", 0.02)), gen)
    attach_bench_engram(model, cfg, seed)
    settle_weights(model)
    return model.eval()


def part_bytes(model: Model, cfg: DeepseekV41ArchConfig) -> dict[str, int]:
    """Resident bytes by part: routed experts, the rest of the MoE (shared expert, router), attention (with the
    indexer and compressors), Engram's projections, Engram's tables (host), embedding + head, and the rest
    (norms, hyper-connections)."""
    from dgpp_deepseek.v41_memory import engram_table_bytes

    parts = dict.fromkeys(("routed experts", "shared expert + router", "attention", "engram projections"), 0)
    parts.update({"embedding + head": 0, "norms + hyper-connections": 0})
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".ffn.experts." in name:
            key = "routed experts"
        elif ".ffn." in name:
            key = "shared expert + router"
        elif ".attn." in name:
            key = "attention"
        elif ".engram." in name:
            key = "engram projections"
        elif name.startswith(("embed.", "head.")):
            key = "embedding + head"
        else:
            key = "norms + hyper-connections"
        parts[key] += size
    parts["engram tables (host)"] = engram_table_bytes(cfg)
    return parts


def cache_bytes(model: Model, batch: int, tokens: int) -> int:
    """Cache pool bytes for ``batch`` sequences of ``tokens`` tokens (paged entries and per-request state)."""
    from dgpp.plugin_api import kv_bytes_per_token, state_bytes_per_request

    return batch * tokens * kv_bytes_per_token(model) + batch * state_bytes_per_request(model)


def bench_geometries() -> list[BenchGeometry]:
    engram = V41_FLASH_TEXT["engram_vocab_size"]
    return [
        BenchGeometry(
            f"deepseek-v4.1-flash-{V41_FLASH_LAYERS}l",
            root_config(V41_FLASH_TEXT),
            "DeepSeek-V4.1-Flash's per-layer shape, 8 of 40 layers with every CSA2 role, in the release's packed "
            f"formats (MXFP4 experts, FP8 32 x 32); Engram tables of {engram:,}-row buckets resident on the host",
            build=build_packed_v41,
        ),
        BenchGeometry(
            "tiny-deepseek-v41", root_config(TINY_V41_TEXT), "its CPU smoke version", build=build_packed_v41
        ),
    ]


def main() -> int:
    raw = root_config(V41_FLASH_TEXT)
    cfg = DeepseekV41ArchConfig.from_hf_config(raw)
    model = packed_model(raw, "meta")
    parts = part_bytes(model, cfg)
    for part, size in parts.items():
        print(f"{part:28s} {size / 1e9:8.2f} GB")
    device = sum(v for k, v in parts.items() if "host" not in k)
    pools = cache_bytes(model, 64, 256)
    print(
        f"{'on the device':28s} {device / 1e9:8.2f} GB; cache pools for 64 x 256 tokens {pools / 1e9:.3f} GB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
