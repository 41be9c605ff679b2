"""Tiny random ``deepseek_v4`` checkpoints in the release's tensor names (``embed.weight``, ``layers.N.attn.wq_a``,
``layers.N.hc_attn_fn``, ``layers.N.ffn.experts.E.w1``, ``hc_head_fn``, ``head.weight``: no ``model.`` prefix),
which transformers loads through its conversion mapping.

The default shape has every layer kind (sliding, HCA, CSA twice), a window, compression ratios and ``index_topk``
smaller than the test prompts, 16 indexer heads, and two hash layers whose ``tid2eid`` gives every token distinct
experts. Parameters transformers initializes to constants (sinks, ``ape``, hyper-connection bases and scales,
the correction bias, norms) are drawn at random so that dropping any of them moves the logits.

``tiny_checkpoints`` and ``bench_geometries`` offer the builders (``deepseek_v4``, ``deepseek_v41``) and the
DeepSeek-V4-Flash and DeepSeek-V4.1-Flash (``dgpp_deepseek.v41_bench``) benchmark geometries to core.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dgpp.plugin_api import BenchGeometry, PackedRelease, TinyCheckpoint
from dgpp.testing.builders import save_one_file

TINY_DEEPSEEK_V4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 128,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "layer_types": [
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "sliding_window": 6,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "hc_mult": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "eos_token_id": 1,
    "bos_token_id": 0,
}


def tiny_deepseek_v4_config(**overrides: Any) -> dict[str, Any]:
    cfg = dict(TINY_DEEPSEEK_V4)
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def _spread_weights(model: torch.nn.Module, gen: torch.Generator, num_experts: int) -> None:
    def randn(shape: torch.Size, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)

    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(randn(p.shape, 0.2, 1.0))
        elif name.endswith(".sinks"):
            p.copy_(randn(p.shape, 1.5))
        elif name.endswith("position_bias"):
            p.copy_(randn(p.shape, 0.5))
        elif name.endswith(("hc.base", "hc_head.hc_base")):
            p.copy_(randn(p.shape, 0.5))
        elif name.endswith(("hc.scale", "hc_head.hc_scale")):
            p.copy_(randn(p.shape, 0.3, 1.0))
        elif name.endswith(("hc.fn", "hc_head.hc_fn")):
            p.copy_(randn(p.shape, 0.3))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(randn(b.shape, 0.3))
        elif name.endswith("tid2eid"):  # distinct experts per token, as the release's table has
            b.copy_(
                torch.stack(
                    [torch.randperm(num_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
                )
            )


def _release_name(hf_saved: str) -> str:
    """transformers' saved name -> the release's (what its conversion mapping reads back)."""
    name = hf_saved.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name.removeprefix("hc_head.hc_")
    return name


def build_tiny_deepseek_v4(
    out_dir: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Write a random ``DeepseekV4ForCausalLM`` checkpoint (config.json + model.safetensors) to ``out_dir``."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    out = Path(out_dir)
    cfg = tiny_deepseek_v4_config(**overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**kwargs, dtype=str(dtype).removeprefix("torch."))).to(
        dtype
    )
    _spread_weights(model.eval(), torch.Generator().manual_seed(seed + 1), cfg["n_routed_experts"])
    path = save_one_file(model, out, "deepseek_v4") / "model.safetensors"
    tensors = load_file(path)
    save_file({_release_name(k): v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    return out


def add_dspark_stages(
    checkpoint_dir: str | Path,
    *,
    stages: int = 3,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] = (1, 2, 3),
    experts: int = 4,
    rank: int = 8,
    repeat_bias: float = 40.0,
    seed: int = 0,
) -> Path:
    """Add DSpark draft stages to a tiny checkpoint in place, as DeepSeek-V4-Flash-0731 ships them: ``mtp.<s>``
    window-only blocks (layer 0's tensor names, fresh values, ``experts`` routed experts with a router bias and
    no hash table), ``mtp.0.main_proj`` / ``main_norm``, the last stage's ``norm``, ``hc_head_*``, Markov head
    and confidence head, and the ``dspark_*`` keys in config.json. ``repeat_bias``: the Markov head's pull
    towards repeating the previous token (so drafts are accepted where the model repeats itself)."""
    import json

    from safetensors.torch import load_file, save_file

    out = Path(checkpoint_dir)
    config = json.loads((out / "config.json").read_text())
    if config["layer_types"][0] != "sliding_attention":
        raise ValueError("the DSpark stages copy layer 0's names, which must be a sliding layer")
    path = out / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab, hc = config["hidden_size"], config["vocab_size"], config["hc_mult"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    def fresh(t: torch.Tensor) -> torch.Tensor:  # another draw of the same scale
        spread = t.float().std() if t.numel() > 1 else t.float().abs().mean()
        return (t.float() + 0.5 * spread * randn(*t.shape)).to(t.dtype)

    extra: dict[str, torch.Tensor] = {}
    for stage in range(stages):
        pre = f"mtp.{stage}."
        for name, t in tensors.items():
            if not name.startswith("layers.0.") or name.endswith("tid2eid"):
                continue
            rest = name.removeprefix("layers.0.").replace("attn.norm.", "attn.kv_norm.")  # the release's name
            if rest.startswith("ffn.experts.") and int(rest.split(".")[2]) >= experts:
                continue
            value = t[:experts] if rest == "ffn.gate.weight" else t
            extra[pre + rest] = fresh(value).contiguous()
        extra[pre + "ffn.gate.bias"] = 0.3 * randn(experts)
    width = len(target_layer_ids) * hidden
    extra["mtp.0.main_proj.weight"] = randn(hidden, width) / width**0.5
    extra["mtp.0.main_norm.weight"] = 1.0 + 0.2 * randn(hidden)
    last = f"mtp.{stages - 1}."
    extra[last + "norm.weight"] = 1.0 + 0.2 * randn(hidden)
    extra[last + "hc_head_fn"] = 0.3 * randn(hc, hc * hidden)
    extra[last + "hc_head_base"] = 0.5 * randn(hc)
    extra[last + "hc_head_scale"] = 1.0 + 0.3 * randn(1)
    embed = randn(vocab, rank)
    embed = embed / embed.norm(dim=-1, keepdim=True)
    extra[last + "markov_head.markov_w1.weight"] = embed
    extra[last + "markov_head.markov_w2.weight"] = repeat_bias * embed + 0.3 * randn(vocab, rank)
    extra[last + "confidence_head.proj.weight"] = 0.2 * randn(1, hidden + rank)
    dtype = tensors["embed.weight"].dtype
    fp32 = ("hc_head_", "gate.bias")  # the release keeps these fp32 whatever the model's dtype
    extra = {k: v if any(f in k for f in fp32) else v.to(dtype) for k, v in extra.items()}
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    config.update(
        dspark_block_size=block_size,
        dspark_noise_token_id=vocab - 1,
        dspark_target_layer_ids=list(target_layer_ids),
        dspark_markov_rank=rank,
        num_nextn_predict_layers=stages,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash-0731) per layer: hidden 4096, 64 q heads x 512 over one shared
# latent, q_lora 1024, o_lora 1024 in 8 groups, a 128-token window everywhere, CSA (ratio 4, 64-head indexer x 128,
# top 512) and HCA (ratio 128) layers, 256 experts top-6 of 2048 + one shared, hash routing on layers 0-2, 4
# hyper-connection streams. 43 layers are 570 GB in bf16 (the release ships MXFP4 experts): the benchmark keeps the
# per-layer shape and runs 8 (2 sliding, then CSA / HCA alternating, as the release starts), 106 GB.
V4_FLASH_LAYERS = 8
_V4_FLASH_TYPES = ["sliding_attention"] * 2 + [
    "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention"
    for i in range(V4_FLASH_LAYERS - 2)
]
V4_FLASH_BENCH: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": V4_FLASH_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "layer_types": _V4_FLASH_TYPES,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * (V4_FLASH_LAYERS - 3),
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
# its CPU smoke version: every layer kind, window / ratios / top-k below the bench's prompts
TINY_V4_BENCH: dict[str, Any] = {
    **V4_FLASH_BENCH,
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 4,
    "layer_types": [
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
        "compressed_sparse_attention",
    ],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.08,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


def tiny_checkpoints() -> list[TinyCheckpoint]:
    from dgpp_deepseek.v41_testing import build_tiny_deepseek_v41

    return [
        TinyCheckpoint(
            "deepseek_v4", build_tiny_deepseek_v4, "DeepSeek-V4: every attention kind, hash + MoE"
        ),
        TinyCheckpoint(
            "deepseek_v41", build_tiny_deepseek_v41, "DeepSeek-V4.1: every CSA2 role, Engram, single-pass mHC"
        ),
    ]


def bench_geometries() -> list[BenchGeometry]:
    from dgpp_deepseek.loader import checkpoint_name
    from dgpp_deepseek.release_layout import RELEASE_DENSE, RELEASE_QUANTIZATION, dense_entry
    from dgpp_deepseek.v41_bench import bench_geometries as v41_geometries

    # ``dgpp bench --quant``: the release's tensor names (w1/w3/w2 experts, ``.scale``), the modules it stores
    # BF16 (router, compressors, the indexer's weights_proj, head) and its formats (``--quant release``)
    release = PackedRelease(
        checkpoint_name, keep_dense=(dense_entry(RELEASE_DENSE),), quantization_config=RELEASE_QUANTIZATION
    )
    return [
        *v41_geometries(),
        BenchGeometry(
            f"deepseek-v4-flash-{V4_FLASH_LAYERS}l",
            V4_FLASH_BENCH,
            "DeepSeek-V4-Flash's per-layer shape",
            release=release,
        ),
        BenchGeometry("tiny-deepseek-v4", TINY_V4_BENCH, "its CPU smoke version", release=release),
    ]
