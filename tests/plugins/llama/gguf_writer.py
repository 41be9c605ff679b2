"""Write an HF Llama checkpoint as a GGUF file the way llama.cpp's converter lays it out (for tests).

Tensor names go to llama.cpp's (``blk.N.attn_q.weight``), q/k rows are permuted into llama.cpp's
interleaved order, and each tensor is stored in the type ``tensor_type(name, tensor)`` picks (F32, F16,
BF16 or a block quant the ``gguf`` package encodes: Q8_0, Q4_0, Q4_1). The tokenizer comes from the
checkpoint's tokenizer.json (a byte-level BPE), the chat template from ``chat_template``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dgpp_llama.gguf_arch import LLAMA_BLOCK_NAMES, LLAMA_GLOBAL_NAMES

# the number llama.cpp gives each token kind in tokenizer.ggml.token_type
NORMAL, CONTROL = 1, 3


def permute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """HF rotate-half row order -> llama.cpp's interleaved order (the inverse of ``unpermute_rows``)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()
    )


def gguf_name(hf_name: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    for gg, hf in LLAMA_GLOBAL_NAMES.items():
        if stem == hf:
            return f"{gg}.{kind}"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.<module>
    inverse = {hf: gg for gg, hf in LLAMA_BLOCK_NAMES.items()}
    return f"blk.{layer}.{inverse[rest]}.{kind}"


def all_f32(name: str, tensor: torch.Tensor) -> str:
    return "F32"


def write_llama_gguf(
    checkpoint_dir: str | Path,
    out_path: str | Path,
    *,
    tensor_type: Callable[[str, torch.Tensor], str] = all_f32,
    chat_template: str | None = None,
) -> Path:
    """Write ``checkpoint_dir`` (config.json, model.safetensors, tokenizer.json) as GGUF ``out_path``."""
    import gguf
    from safetensors.torch import load_file

    src = Path(checkpoint_dir)
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), "llama")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, src / "tokenizer.json", cfg, chat_template)
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            tensor = permute_rows(tensor, heads)
        elif ".self_attn.k_proj." in name:
            tensor = permute_rows(tensor, kv_heads)
        kind = tensor_type(name, tensor)
        data = tensor.float().numpy()
        if kind == "F32":
            writer.add_tensor(gguf_name(name), data)
        elif kind == "F16":
            writer.add_tensor(gguf_name(name), data.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, tokenizer_json: Path, cfg: dict, chat_template: str | None) -> None:
    spec = json.loads(tokenizer_json.read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab.update(specials)
    tokens = [""] * cfg["vocab_size"]
    types = [NORMAL] * cfg["vocab_size"]
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = CONTROL if token in specials else NORMAL
    for i, token in enumerate(tokens):  # ids the tokenizer does not use still need a unique spelling
        if not token:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    if eos is not None:
        writer.add_eos_token_id(eos)
    if chat_template:
        writer.add_chat_template(chat_template)
