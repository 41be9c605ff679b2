"""Tiny random ``qwen4_exp`` (Qwen3.8-Flash-Next) checkpoints, saved by transformers' own
``Qwen4ExpForCausalLM`` so tensor names, the sharded n-gram table and config.json are a release's.

The fixture is scaled so every feature is on the tested path: two Gated DeltaNet layers carrying PLE
(one-indexed ids 1 and 3, so two different hash seeds), two QSA layers whose indexer keeps 4 blocks of
4 tokens (prompts over 19 tokens take the sparse path) with 16 indexer heads (ReLU-zero scores do not
tie at the cut), 4 residual streams, 8 routed experts plus a gated shared expert, partial RoPE.

transformers has no MTP module for this architecture (it drops ``mtp.*`` on load); ``with_mtp`` adds
one MTP layer in the layout ``dgpp_qwen.draft`` reads, built from transformers' own decoder-layer and
gated-residual classes (``build_hf_mtp``), so a test can run the same modules in float64 as reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from dgpp_qwen.testing_qwen3 import TINY_VISION, _hybrid_layer_types

EOS = 7
TINY_QWEN4_EXP: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
    "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    },
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "hc_count": 4,
    "hc_lowrank": 16,
    "ple_layer_ids": [1, 3],
    "ngram_vocab_size_base": 1000,
    "split_ngram_parts": 4,
    "indexer_n_heads": 16,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 16,
    "indexer_compress_ratio": 4,
    "eos_token_id": EOS,
}
# a vision tower small enough for CPU tests: 4-pixel patches, an 8 x 8 learned position grid, two blocks
TINY_QWEN4_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": TINY_QWEN4_EXP["hidden_size"],
    "num_position_embeddings": 64,
    "initializer_range": 0.1,
}
# the tiny tokenizer's ids after its own added tokens (dgpp.testing.tokenizers), for the image markers
VISION_TOKENS = {
    "vision_start_token_id": (505, "<|vision_start|>"),
    "vision_end_token_id": (506, "<|vision_end|>"),
    "image_token_id": (507, "<|image_pad|>"),
    "video_token_id": (508, "<|video_pad|>"),
}
# Qwen2-VL's image processor settings for that tower: sides multiples of 8 pixels, 8² .. 48² pixels
TINY_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 64, "longest_edge": 48 * 48},
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Qwen3.8-Flash-Next's text model per layer (the release's text_config keys): hidden 2560, 48 layers in the
# pattern GDN, GDN, GDN, QSA (36 Gated DeltaNet of 16 k / 48 v heads x 128 with a sigmoid output gate, 12 QSA of
# 24 q / 2 kv heads x 256 with a 4-head indexer keeping 2048 tokens in 4-token blocks), each followed by 512
# experts top-10 of 640 + a gated shared expert of 640; 4 residual streams; the PLE n-gram embedding on layer
# index 1. In bf16 a layer's experts are 5.0 GB: the benchmark keeps the first QWEN4_EXP_LAYERS (the pattern twice:
# 6 GDN + 2 QSA, 44 GB of parameters in bf16). The one other scaled size is the n-gram table: a hash base of
# 200,000 instead of 20,000,000 gives 3.2M rows (1.0 GB in bf16) instead of 320M (102 GB); a token still looks up
# 16 rows of 160.
QWEN4_EXP_LAYERS = 8
QWEN4_EXP_BENCH_NGRAM_BASE = 200_000
QWEN4_EXP_BENCH: dict[str, Any] = {
    "model_type": "qwen4_exp",
    "architectures": ["Qwen4ExpForConditionalGeneration"],
    "text_config": {
        "vocab_size": 248320,
        "hidden_size": 2560,
        "num_hidden_layers": QWEN4_EXP_LAYERS,
        "layer_types": _hybrid_layer_types(QWEN4_EXP_LAYERS),
        "num_attention_heads": 24,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "output_gate_type": "sigmoid",
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 640,
        "shared_expert_intermediate_size": 640,
        "norm_topk_prob": True,
        "hc_count": 4,
        "hc_lowrank": 320,
        "ple_layer_ids": [2],
        "ple_embed_dim": 2560,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "ngram_vocab_size_base": QWEN4_EXP_BENCH_NGRAM_BASE,
        "split_ngram_parts": 128,
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 128,
        "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "eos_token_id": 248044,
        "bos_token_id": 248044,
    },
    "tie_word_embeddings": False,
}
# the CPU smoke version of the benchmark geometry: the tiny test model's text config
TINY_QWEN4_EXP_BENCH: dict[str, Any] = {
    "model_type": "qwen4_exp",
    "architectures": ["Qwen4ExpForConditionalGeneration"],
    "text_config": {k: v for k, v in TINY_QWEN4_EXP.items() if k != "tie_word_embeddings"},
    "tie_word_embeddings": False,
}
MTP_LAYER_INDEX = 3  # the transformers layer class is built as this (indexed-attention, no PLE) layer


def build_hf_mtp(config: Any) -> torch.nn.ModuleDict:
    """One MTP layer as transformers modules; ``state_dict()`` names are the checkpoint's after ``mtp.``:
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc`` ``[H, 2H]`` (input ``[embedding | hidden]``),
    ``layers.0`` (a QSA decoder layer with its own gated residuals and MoE) and ``hyper_connection_mixer``."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    hidden = config.hidden_size
    return torch.nn.ModuleDict(
        {
            "pre_fc_norm_embedding": hf.Qwen4ExpTextRMSNorm(hidden, eps=config.rms_norm_eps),
            "pre_fc_norm_hidden": hf.Qwen4ExpTextRMSNorm(hidden, eps=config.rms_norm_eps),
            "fc": torch.nn.Linear(2 * hidden, hidden, bias=False),
            "layers": torch.nn.ModuleList([hf.Qwen4ExpTextDecoderLayer(config, MTP_LAYER_INDEX)]),
            "hyper_connection_mixer": hf.Qwen4ExpTextGatedResidual(config, use_combine=False),
        }
    )


def _randomize(module: torch.nn.Module, gen: torch.Generator, std: float) -> None:
    """Matrices ~ N(0, std); 1-D weights (norms, gates) perturbed away from their init."""
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() == 1:
                p.add_(noise * 0.2)
            else:
                p.copy_(noise * std)


def _add_mtp(text_config: Any, out: Path, dtype: torch.dtype, seed: int) -> None:
    from safetensors.torch import load_file, save_file

    mtp = build_hf_mtp(text_config)
    _randomize(mtp, torch.Generator().manual_seed(seed + 2), text_config.initializer_range)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    tensors.update({f"mtp.{name}": t.to(dtype).contiguous() for name, t in mtp.state_dict().items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


def build_tiny_qwen4_exp(
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    with_mtp: bool = False,
    wrapped: bool = False,
    vision: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random ``Qwen4ExpForCausalLM`` checkpoint to ``out_dir`` (``overrides``: config keys);
    ``wrapped``: the multimodal ``Qwen4ExpForConditionalGeneration`` release layout (text under
    ``text_config`` and ``model.language_model.``, plus a vision tower: ``vision``, default one block)."""
    import transformers

    text = {**TINY_QWEN4_EXP, **(overrides or {})}
    torch.manual_seed(seed)
    if wrapped:
        tie = text.pop("tie_word_embeddings")
        ids = {key: token_id for key, (token_id, _) in VISION_TOKENS.items()}
        config = transformers.Qwen4ExpConfig(
            text_config=text, vision_config=vision or TINY_VISION, tie_word_embeddings=tie, **ids
        )
        model = transformers.Qwen4ExpForConditionalGeneration(config).eval()
    else:
        model = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            elif name.endswith("ple.conv1d.weight"):
                # transformers zero-inits the PLE conv; random weights make the conv path matter
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model = model.to(dtype)
    out = Path(out_dir)
    model.save_pretrained(out)
    if with_mtp:
        _add_mtp(model.config.get_text_config(), out, dtype, seed)
    return out


def build_tiny_qwen4_exp_vl(
    out_dir: str | Path, *, seed: int = 0, with_mtp: bool = False, dtype: torch.dtype = torch.float32
) -> Path:
    """A tiny wrapped ``qwen4_exp`` that reads images (``TINY_QWEN4_VISION``), with the tiny chat tokenizer plus the
    image markers (``VISION_TOKENS``) and a Qwen2-VL ``preprocessor_config.json`` (``TINY_PREPROCESSOR``)."""
    import json

    from tokenizers import AddedToken, Tokenizer

    from dgpp.testing.tokenizers import build_tiny_tokenizer

    out = build_tiny_qwen4_exp(
        out_dir, seed=seed, wrapped=True, vision=TINY_QWEN4_VISION, with_mtp=with_mtp, dtype=dtype
    )
    build_tiny_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    markers = sorted(VISION_TOKENS.values())
    tok.add_special_tokens([AddedToken(text, normalized=False, special=True) for _, text in markers])
    if [tok.token_to_id(text) for _, text in markers] != [i for i, _ in markers]:
        raise AssertionError("the tiny tokenizer's image markers did not land on their ids")
    tok.save(str(out / "tokenizer.json"))
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    return out


@torch.inference_mode()
def mtp_reference_logits(path: str | Path, tokens: list[int]) -> torch.Tensor:
    """Float64 MTP logits of every position of ``tokens[:-1]`` (row ``p`` predicts ``tokens[p + 2]``):
    transformers' main model gives the mixed hidden state, then transformers' decoder-layer and gated-residual
    classes run the ``mtp.*`` tensors (``build_hf_mtp``) glued as ``dgpp_qwen.draft`` documents."""
    import transformers
    from safetensors.torch import load_file

    path = Path(path)
    # eager experts: the grouped-GEMM path has no float64 kernel
    ref = transformers.Qwen4ExpForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    mtp = build_hf_mtp(ref.config).double().eval()
    stored = load_file(str(path / "model.safetensors"))
    mtp.load_state_dict({k[len("mtp.") :]: v.double() for k, v in stored.items() if k.startswith("mtp.")})
    ids = torch.tensor([tokens])
    n = len(tokens) - 1
    hidden = ref.model(ids[:, :-1]).last_hidden_state
    embedded = mtp["pre_fc_norm_embedding"](ref.model.embed_tokens(ids[:, 1:]))
    x = mtp["fc"](torch.cat([embedded, mtp["pre_fc_norm_hidden"](hidden)], dim=-1))
    hyper = x.repeat(1, 1, ref.config.hc_count)
    position_embeddings = ref.model.rotary_emb(hyper, torch.arange(n).view(1, 1, -1).expand(3, 1, -1))
    causal = torch.full((n, n), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)[None, None]
    hyper = cast(torch.nn.ModuleList, mtp["layers"])[0](
        hyper, position_embeddings=position_embeddings, attention_mask=causal, cache=None
    )
    return ref.lm_head(mtp["hyper_connection_mixer"](hyper))[0]
