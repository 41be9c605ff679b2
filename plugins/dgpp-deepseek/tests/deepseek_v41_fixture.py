"""A tiny random DeepSeek-V4.1-Flash checkpoint in the release's layout: ``config.json`` (root ``deepseek_v41``,
the backbone under ``text_config``, the release's ``quantization_config``), ``model.safetensors`` with the
release's tensor names (no ``model.`` prefix) and packed formats, and ``tokenizer.json`` (the Engram token map
is derived from it).

Formats as the release ships them: FP8 E4M3 with E8M0 32 x 32 block ``.scale`` for the attention projections,
the indexer's ``wq_b``, the shared experts and the Engram ``wkv``; MXFP4 routed experts (I8 pairs + E8M0 / 32
``.scale``); the Engram tables as E4M3 rows + E8M0 / 32 ``.scale``; BF16 embedding, head, norms, router,
compressors, the indexer's ``weights_proj`` / ``wk`` and the Engram ``q_weight`` / ``k_weight``; F32 sinks,
hyper-connection parameters and the router's correction bias.

The default shape (``TINY_DEEPSEEK_V41``) has every layer kind, window 6 and the selections far smaller than
a test prompt:

    layer  ratio  role
    0      0      window only
    1      0      window only, Engram
    2      2      kv source + index source (encoder group A)
    3      2      reuses group A's KV and selection
    4      2      kv source + index source (group B), Engram
    5      2      reuses group B
    6      1      kv source + index source + candidate source (decoder group C)
    7      1      reuses group C (layer 6's selection)
    8      1      index source restricted to the candidate pool
    9      1      reuses layer 8's selection

Parameters a fresh model would hold constant (norm weights, sinks, hyper-connection bases / scales, the
correction bias, the Engram q / k weights) are drawn at random so that dropping any of them moves the logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from deepseek_v41_formats import (
    RawTensor,
    encode_engram_rows,
    encode_fp8_block,
    encode_mxfp4,
    raw,
    read_safetensors,
    write_safetensors,
)
from deepseek_v41_reference_config import V41Config, parse_config
from deepseek_v41_reference_engram import bucket_primes, compressed_token_map

F64 = torch.float64

TINY_TEXT: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 10,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 256,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 2,
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 4,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 1.0,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-20,
    "engram_layer_ids": [1, 4],
    "engram_vocab_size": 40,
    "engram_max_ngram_size": 4,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
TINY_DEEPSEEK_V41: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [32, 32],
        "expert_dtype": "fp4",
    },
    "text_config": TINY_TEXT,
}


def tiny_deepseek_v41_config(**text_overrides: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(TINY_DEEPSEEK_V41)
    cfg["text_config"].update(text_overrides)
    return cfg


class _Draw:
    def __init__(self, seed: int, originals: dict[str, torch.Tensor] | None) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, RawTensor] = {}
        self.originals = originals  # the float64 values each packed weight was encoded from

    def normal(self, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=self.gen, dtype=F64)

    def dense(
        self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0, dtype: str = "BF16"
    ) -> None:
        self.tensors[name] = raw(self.normal(shape, std, mean), dtype)

    def keep(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if self.originals is not None:
            self.originals[name] = w
        return w

    def fp8(self, name: str, n: int, k: int) -> None:
        codes, scale = encode_fp8_block(self.keep(name + ".weight", self.normal((n, k), k**-0.5)))
        self.tensors[name + ".weight"] = raw(codes, "F8_E4M3")
        self.tensors[name + ".scale"] = raw(scale, "F8_E8M0")

    def mxfp4(self, name: str, n: int, k: int) -> None:
        packed, scale = encode_mxfp4(self.keep(name + ".weight", self.normal((n, k), k**-0.5)))
        self.tensors[name + ".weight"] = raw(packed, "I8")
        self.tensors[name + ".scale"] = raw(scale, "F8_E8M0")


def _attention(d: _Draw, cfg: V41Config, layer: int, prefix: str | None = None) -> None:
    p = (prefix or f"layers.{layer}.") + "attn."
    h, hd, heads, ql = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    d.fp8(p + "wq_a", ql, h)
    d.dense(p + "q_norm.weight", (ql,), 0.2, 1.0)
    d.fp8(p + "wq_b", heads * hd, ql)
    d.fp8(p + "wkv", hd, h)
    d.dense(p + "kv_norm.weight", (hd,), 0.2, 1.0)
    d.fp8(p + "wo_a", cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups)
    d.fp8(p + "wo_b", h, cfg.o_groups * cfg.o_lora_rank)
    d.dense(p + "attn_sink", (heads,), 1.0, dtype="F32")
    if layer in cfg.kv_source_layer_ids:
        d.dense(p + "compressor.wkv.weight", (hd, h), h**-0.5)
        if cfg.ratio(layer) > 1:
            d.dense(p + "compressor.wgate.weight", (hd, h), 2 * h**-0.5)
        d.dense(p + "compressor.norm.weight", (hd,), 0.2, 1.0)
    if layer in cfg.index_source_layer_ids:
        d.fp8(p + "indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, ql)
        d.dense(p + "indexer.weights_proj.weight", (cfg.index_n_heads, h), h**-0.5)
        if layer in cfg.kv_source_layer_ids:
            d.dense(p + "indexer.wk.weight", (cfg.index_head_dim, hd), hd**-0.5)
            d.dense(p + "indexer.k_norm.weight", (cfg.index_head_dim,), 0.2, 1.0)


def _ffn(
    d: _Draw,
    cfg: V41Config,
    layer: int,
    inter: int,
    shared_inter: int,
    prefix: str | None = None,
    experts: int = 0,
) -> None:
    p = (prefix or f"layers.{layer}.") + "ffn."
    h, experts = cfg.hidden_size, experts or cfg.n_routed_experts
    d.dense(p + "gate.weight", (experts, h), h**-0.5)
    d.dense(p + "gate.bias", (experts,), 0.3, dtype="F32")
    for e in range(experts):
        d.mxfp4(f"{p}experts.{e}.w1", inter, h)
        d.mxfp4(f"{p}experts.{e}.w3", inter, h)
        d.mxfp4(f"{p}experts.{e}.w2", h, inter)
    d.fp8(p + "shared_experts.w1", shared_inter, h)
    d.fp8(p + "shared_experts.w3", shared_inter, h)
    d.fp8(p + "shared_experts.w2", h, shared_inter)


def _hyper_connections(d: _Draw, cfg: V41Config, layer: int, prefix: str | None = None) -> None:
    hc, h = cfg.hc_mult, cfg.hidden_size
    for site in ("attn", "ffn"):
        p = (prefix or f"layers.{layer}.") + f"hc_{site}_"
        d.dense(p + "fn", ((2 + hc) * hc, hc * h), (hc * h) ** -0.5, dtype="F32")
        d.dense(p + "base", ((2 + hc) * hc,), 0.5, dtype="F32")
        d.dense(p + "scale", (3,), 0.3, 1.0, dtype="F32")


def _engram(d: _Draw, cfg: V41Config, layer: int, rows: int) -> None:
    p = f"layers.{layer}.engram."
    codes, scale = encode_engram_rows(d.keep(p + "embed.weight", d.normal((rows, cfg.engram_head_dim), 1.0)))
    d.tensors[p + "embed.weight"] = raw(codes, "F8_E4M3")
    d.tensors[p + "embed.scale"] = raw(scale, "F8_E8M0")
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads * cfg.engram_head_dim
    d.fp8(p + "wkv", (cfg.hc_mult + 1) * cfg.hidden_size, cols)
    d.dense(p + "q_weight", (cfg.hc_mult, cfg.hidden_size), 0.3, 1.0)
    d.dense(p + "k_weight", (cfg.hc_mult, cfg.hidden_size), 0.3, 1.0)


def build_tiny_deepseek_v41(
    out_dir: str | Path,
    *,
    seed: int = 0,
    originals: dict[str, torch.Tensor] | None = None,
    **text_overrides: Any,
) -> Path:
    """Write the tiny release-layout checkpoint (config.json, model.safetensors, tokenizer files) to ``out_dir``.
    ``originals``, when given, receives the float64 values every packed ``X.weight`` was encoded from."""
    from dgpp.testing.tokenizers import build_tiny_tokenizer

    out = Path(out_dir)
    root = tiny_deepseek_v41_config(**text_overrides)
    text = root["text_config"]
    build_tiny_tokenizer(out, vocab_size=int(text["vocab_size"]))
    _, classes = compressed_token_map(out / "tokenizer.json")
    text["engram_compressed_vocab_size"] = classes
    primes = bucket_primes(
        len(text["engram_layer_ids"]),
        int(text["engram_max_ngram_size"]),
        int(text["engram_n_heads"]),
        int(text["engram_vocab_size"]),
    )
    text["engram_num_embeddings"] = [sum(sum(h) for h in layer) for layer in primes]
    (out / "config.json").write_text(json.dumps(root, indent=2) + "\n")
    cfg = parse_config(root)

    d = _Draw(seed, originals)
    h = cfg.hidden_size
    d.dense("embed.weight", (cfg.vocab_size, h), 1.0)
    d.dense("norm.weight", (h,), 0.2, 1.0)
    d.dense("head.weight", (cfg.vocab_size, h), h**-0.5)
    inter = int(text["moe_intermediate_size"])
    shared_inter = inter * int(text.get("n_shared_experts", 1))
    for layer in range(cfg.num_hidden_layers):
        _attention(d, cfg, layer)
        _ffn(d, cfg, layer, inter, shared_inter)
        _hyper_connections(d, cfg, layer)
        d.dense(f"layers.{layer}.attn_norm.weight", (h,), 0.2, 1.0)
        d.dense(f"layers.{layer}.ffn_norm.weight", (h,), 0.2, 1.0)
        if layer in cfg.engram_layer_ids:
            _engram(d, cfg, layer, cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)])
    write_safetensors(out / "model.safetensors", d.tensors)
    return out


def add_dspark_stages_v41(
    out_dir: str | Path,
    *,
    stages: int = 3,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] = (6, 7, 8),
    experts: int = 4,
    experts_per_tok: int = 2,
    rank: int = 8,
    repeat_bias: float = 40.0,
    seed: int = 1,
) -> Path:
    """Add DSpark draft stages to a tiny checkpoint in place, in the release's layout: ``mtp.<s>`` window-only
    V4.1 blocks (attention, ``experts`` routed experts top ``experts_per_tok`` with a router bias and a shared
    expert, hyper-connections, norms), ``mtp.0.main_proj`` (FP8 blocks) / ``main_norm``, the last stage's
    ``norm``, Markov head and confidence head (BF16), and the keys in ``text_config``. ``repeat_bias``: the Markov
    head's pull towards repeating the previous token (drafts stand where the model repeats itself)."""
    out = Path(out_dir)
    root = json.loads((out / "config.json").read_text())
    text = root["text_config"]
    layers = int(text["num_hidden_layers"])
    text.update(
        compress_ratios=list(text["compress_ratios"])[:layers] + [0] * stages,
        num_nextn_predict_layers=stages,
        dspark_block_size=block_size,
        dspark_noise_token_id=int(text["vocab_size"]) - 1,
        dspark_target_layer_ids=list(target_layer_ids),
        dspark_markov_rank=rank,
        dspark_n_routed_experts=experts,
        dspark_num_experts_per_tok=experts_per_tok,
    )
    cfg = parse_config(root)
    d = _Draw(seed, None)
    h, vocab = cfg.hidden_size, cfg.vocab_size
    inter = int(text["moe_intermediate_size"])
    shared_inter = inter * int(text.get("n_shared_experts", 1))
    for s in range(stages):
        p = f"mtp.{s}."
        _attention(d, cfg, layers + s, p)
        _ffn(d, cfg, layers + s, inter, shared_inter, p, experts)
        _hyper_connections(d, cfg, layers + s, p)
        d.dense(p + "attn_norm.weight", (h,), 0.2, 1.0)
        d.dense(p + "ffn_norm.weight", (h,), 0.2, 1.0)
    d.fp8("mtp.0.main_proj", h, len(target_layer_ids) * h)
    d.dense("mtp.0.main_norm.weight", (h,), 0.2, 1.0)
    last = f"mtp.{stages - 1}."
    d.dense(last + "norm.weight", (h,), 0.2, 1.0)
    embed = d.normal((vocab, rank), 1.0)
    embed = embed / embed.norm(dim=-1, keepdim=True)
    d.tensors[last + "markov_head.markov_w1.weight"] = raw(embed, "BF16")
    d.tensors[last + "markov_head.markov_w2.weight"] = raw(
        repeat_bias * embed + d.normal((vocab, rank), 0.3), "BF16"
    )
    d.dense(last + "confidence_head.proj.weight", (1, h + rank), 0.2)
    write_safetensors(out / "model.safetensors", {**read_safetensors(out / "model.safetensors"), **d.tensors})
    (out / "config.json").write_text(json.dumps(root, indent=2) + "\n")
    return out


def fit_markov_bigrams(out_dir: str | Path, sequences: list[list[int]], strength: float = 40.0) -> Path:
    """Rewrite the last DSpark stage's Markov head in place so that it drafts, after a token, the token that
    followed it in ``sequences`` (a bigram table in rank space: ``markov_w1[prev]`` is the unit vector of slot
    ``prev % rank``, ``markov_w2[next]`` adds ``strength`` on the slots of the tokens ``next`` followed). Tokens
    that share a slot, or followed different tokens, draft one of them; the block's base logits decide the rest."""
    out = Path(out_dir)
    root = json.loads((out / "config.json").read_text())
    text = root["text_config"]
    rank, vocab = int(text["dspark_markov_rank"]), int(text["vocab_size"])
    last = f"mtp.{int(text['num_nextn_predict_layers']) - 1}.markov_head."
    w1 = torch.zeros(vocab, rank, dtype=F64)
    w1[torch.arange(vocab), torch.arange(vocab) % rank] = 1.0
    w2 = torch.zeros(vocab, rank, dtype=F64)
    for seq in sequences:
        for prev, nxt in zip(seq, seq[1:], strict=False):
            w2[nxt, prev % rank] = strength
    tensors = read_safetensors(out / "model.safetensors")
    tensors[last + "markov_w1.weight"] = raw(w1, "BF16")
    tensors[last + "markov_w2.weight"] = raw(w2, "BF16")
    write_safetensors(out / "model.safetensors", tensors)
    return out
