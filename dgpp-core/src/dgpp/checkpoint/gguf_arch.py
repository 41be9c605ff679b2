"""What a GGUF architecture is in HF terms: its config.json (from ``<arch>.*`` metadata) and its tensor
names (llama.cpp's ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``).

llama.cpp's converter reorders the rows of Llama's q and k projections (per head, the two rotary halves
are interleaved so its kernels can rotate adjacent pairs); ``unpermute_rows`` puts them back into HF's
rotate-half order. Only ``llama`` is mapped so far; any other ``general.architecture`` is refused by
name. A family plugin then loads the converted checkpoint like any other.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dgpp.checkpoint.gguf_file import GGUFFile
from dgpp.errors import CheckpointError

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
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")
SUPPORTED_ARCHITECTURES = ("llama",)


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows ``(pair i, half h)`` go back to ``(half h, pair i)``.

    Works for a weight ``[heads * head_dim, in]`` and a bias ``[heads * head_dim]``.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    rest = weight.shape[1:]
    return weight.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def _architecture(gguf: GGUFFile) -> str:
    arch = gguf.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{gguf.path}: general.architecture {arch!r} is not supported for GGUF checkpoints "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return arch


def llama_config(gguf: GGUFFile, vocab_size: int) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM`` from ``llama.*`` metadata (keys as transformers reads them)."""
    arch = _architecture(gguf)

    def key(name: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{name}"
        return gguf.require(full) if required else gguf.get(full, default)

    hidden = key("embedding_length", required=True)
    heads = key("attention.head_count", required=True)
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(
            f"{gguf.path}: {arch}.rope.dimension_count {key('rope.dimension_count')} != head_dim {head_dim} "
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
                f"{gguf.path}: {arch}.rope.scaling.type {scaling!r} is not supported (linear, yarn)"
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


def hf_tensor_name(gguf: GGUFFile, name: str) -> str:
    """The HF name of GGUF tensor ``name``; an unknown one is refused by name."""
    block = _BLOCK_NAME.match(name)
    if block and block.group(2) in LLAMA_BLOCK_NAMES:
        return f"model.layers.{block.group(1)}.{LLAMA_BLOCK_NAMES[block.group(2)]}.{block.group(3)}"
    glob = _GLOBAL_NAME.match(name)
    if glob and glob.group(1) in LLAMA_GLOBAL_NAMES:
        return f"{LLAMA_GLOBAL_NAMES[glob.group(1)]}.{glob.group(2)}"
    raise CheckpointError(
        f"{gguf.path}: tensor {name!r} has no mapping for architecture {_architecture(gguf)!r}"
    )


def hf_tensors(gguf: GGUFFile, config: dict[str, Any]):
    """Yield ``(hf_name, tensor)`` for every tensor of the file, q/k rows back in HF order."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name in gguf.tensor_names():
        hf_name = hf_tensor_name(gguf, name)
        tensor = gguf.tensor(name)
        if ".self_attn.q_proj." in hf_name:
            tensor = unpermute_rows(tensor, heads)
        elif ".self_attn.k_proj." in hf_name:
            tensor = unpermute_rows(tensor, kv_heads)
        yield hf_name, tensor
