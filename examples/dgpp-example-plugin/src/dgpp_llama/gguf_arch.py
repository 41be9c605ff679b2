"""What a llama.cpp ``llama`` GGUF file is in HF terms: its config.json (from ``llama.*`` metadata) and its tensor
names (``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``), offered to core's GGUF converter
(``dgpp_gguf_architectures``). llama.cpp interleaves the rotary halves of q and k per head; core puts them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dgpp.plugin_api import CheckpointError, GGUFArchitecture

if TYPE_CHECKING:
    from dgpp.plugin_api import GGUFFile

ARCH = "llama"
# llama.cpp tensor stem -> HF module path (inside model.layers.N for the per-block ones)
LLAMA_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def llama_config(gguf: GGUFFile, vocab_size: int) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM`` from ``llama.*`` metadata (keys as transformers reads them)."""

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{ARCH}.{name}"
        return gguf.require(full) if required else gguf.get(full, default)

    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(
            f"{gguf.path}: {ARCH}.rope.dimension_count {key('rope.dimension_count')} != head_dim {head_dim} "
            "(partial rotary is not supported for llama)"
        )
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": key("vocab_size", vocab_size),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensor_names(),
        "mlp_bias": "blk.0.ffn_up.bias" in gguf.tensor_names(),
        "tie_word_embeddings": "output.weight" not in gguf.tensor_names(),
        "dtype": "float32",
    }
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise CheckpointError(
                f"{gguf.path}: {ARCH}.rope.scaling.type {scaling!r} is not supported (linear, yarn)"
            )
        rope: dict[str, Any] = {
            "rope_type": scaling,
            "factor": float(key("rope.scaling.factor", required=True)),
        }
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = key(
                "rope.scaling.original_context_length", required=True
            )
        config["rope_scaling"] = rope
    return config


def gguf_architectures() -> list[GGUFArchitecture]:
    return [
        GGUFArchitecture(
            name=ARCH,
            hf_config=llama_config,
            global_names=LLAMA_GLOBAL_NAMES,
            block_names=LLAMA_BLOCK_NAMES,
            interleaved_rows={
                "self_attn.q_proj": "num_attention_heads",
                "self_attn.k_proj": "num_key_value_heads",
            },
        )
    ]
