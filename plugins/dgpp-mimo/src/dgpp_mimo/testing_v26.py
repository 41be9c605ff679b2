"""MiMo-V2.6 (``mimo_v2``) checkpoints in the release layout, written from a ``mimo_v2_flash``-layout one, and
their dequantized ``mimo_v2_flash``-layout twins.

``write_v26_checkpoint(flash_dir, v26_dir, twin_dir)`` reads a (tiny, float) ``mimo_v2_flash`` checkpoint as
transformers saves it and writes:

- ``v26_dir``: the release's config keys (``hybrid_layer_pattern``, ``moe_layer_freq``, ``layernorm_epsilon``,
  ``rope_theta`` / ``swa_rope_theta``, ``swa_*`` heads, sink flags, ``attention_projection_layout:
  fused_qkv``, ``sliding_window`` = ``sliding_window_size``) and tensors: per layer one ``qkv_proj`` of
  ``num_key_value_heads`` chunks ``[Q | K | V]`` of that chunk's heads, each chunk FP8 E4M3 with its own
  128x128 scale grid; FP8 dense MLPs; MXFP4 routed experts (E2M1 + E8M0 per 32); ``o_proj``, router, norms,
  embedding and head as they were; optional MTP layers (``model.mtp.layers.K.*``, random); and a few vision /
  audio tensors the engine must skip.
- ``twin_dir``: the same model in the ``mimo_v2_flash`` layout with every packed weight replaced by the
  value it decodes to (q/k/v cut back out of the decoded chunks), so transformers or the flash model running
  the twin is the reference the V2.6 path must equal. Its MTP layers (when written) are in the flash names
  (``self_attn.q_proj`` ...), dequantized, for a float reference of the drafter.

The split back from the fused form here is written independently of the plugin's reader on purpose: the two
must agree for the adapter test to pass.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4
from dgpp.quant.fp8 import FP8Block
from dgpp.testing.builders import TINY_TEXT

# MiMo-V2.6-Flash's config.json text keys: 48 layers, global attention on 0, 5, 11, ..., 47
MIMO_V26_RELEASE: dict[str, Any] = {
    "architectures": ["MiMoV2ForCausalLM"],
    "model_type": "mimo_v2",
    "vocab_size": 152576,
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 192,
    "v_head_dim": 128,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 192,
    "swa_v_head_dim": 128,
    "hybrid_layer_pattern": [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(48)],
    "moe_layer_freq": [0] + [1] * 47,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000000.0,
    "swa_rope_theta": 10000.0,
    "partial_rotary_factor": 0.334,
    "attention_value_scale": 0.707,
    "sliding_window": 128,
    "sliding_window_size": 128,
    "add_swa_attention_sink_bias": True,
    "add_full_attention_sink_bias": False,
    "attention_projection_layout": "fused_qkv",
    "attention_bias": False,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": None,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_shared_experts": None,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "eos_token_id": 151645,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 3,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "mxfp4_block_size": 32,
    },
}
FP8 = FP8Block(block=(128, 128))
EXPERT_FORMAT = MXFP4()
V26_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "mxfp4_block_size": 32,
}
AUX_TENSORS = ("visual.patch_embed.proj.weight", "audio_encoder.layers.0.fc1.weight")


def _roundtrip(fmt: Any, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``fmt``'s stored tensors for ``w`` and the value they decode to (in ``w``'s dtype)."""
    packed = encode(fmt, w.float())
    return packed, fmt.decode(fmt.prepare(dict(packed), tuple(w.shape)), tuple(w.shape), w.dtype)


def v26_config(flash: dict[str, Any], mtp_layers: int) -> dict[str, Any]:
    """The V2.6 config.json describing the model ``flash`` (a ``mimo_v2_flash`` config) describes."""
    rope = flash["rope_parameters"]
    kv = flash["num_key_value_heads"]
    keep = {
        k: v
        for k, v in flash.items()
        if k
        not in (
            "model_type",
            "architectures",
            "layer_types",
            "mlp_layer_types",
            "rms_norm_eps",
            "rope_parameters",
            "sliding_window",
            "transformers_version",
            "output_router_logits",
        )
    }
    return {
        **keep,
        "model_type": "mimo_v2",
        "architectures": ["MiMoV2ForCausalLM"],
        "hybrid_layer_pattern": [int(t == "sliding_attention") for t in flash["layer_types"]],
        "moe_layer_freq": [int(t == "sparse") for t in flash["mlp_layer_types"]],
        "layernorm_epsilon": flash["rms_norm_eps"],
        "rope_theta": rope["full_attention"]["rope_theta"],
        "swa_rope_theta": rope["sliding_attention"]["rope_theta"],
        "partial_rotary_factor": rope["full_attention"]["partial_rotary_factor"],
        "swa_num_attention_heads": flash["num_attention_heads"],
        "swa_num_key_value_heads": 2 * kv,
        "swa_head_dim": flash["head_dim"],
        "swa_v_head_dim": flash["v_head_dim"],
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_projection_layout": "fused_qkv",
        "sliding_window": flash["sliding_window"],
        "sliding_window_size": flash["sliding_window"],
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_shared_experts": None,
        "num_nextn_predict_layers": mtp_layers,
        "quantization_config": dict(V26_QUANTIZATION),
    }


def _fuse_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: int,
    out: dict[str, torch.Tensor],
    twin: dict[str, torch.Tensor],
    prefix: str,
) -> None:
    """``prefix.qkv_proj`` as the release stores it into ``out``; the decoded q/k/v into ``twin``."""
    parts = [t.reshape(chunks, t.shape[0] // chunks, t.shape[1]) for t in (q, k, v)]
    codes, scales, decoded = [], [], []
    for c in range(chunks):
        packed, value = _roundtrip(FP8, torch.cat([p[c] for p in parts]))
        codes.append(packed["weight"])
        scales.append(packed["weight_scale_inv"])
        decoded.append(value.split([p.shape[1] for p in parts]))
    out[f"{prefix}.qkv_proj.weight"] = torch.cat(codes)
    out[f"{prefix}.qkv_proj.weight_scale_inv"] = torch.cat(scales)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        twin[f"{prefix}.{name}.weight"] = torch.cat([d[i] for d in decoded])


def _packed(
    fmt: Any, name: str, w: torch.Tensor, out: dict[str, torch.Tensor], twin: dict[str, torch.Tensor]
) -> None:
    module = name[: -len(".weight")]
    packed, value = _roundtrip(fmt, w)
    out.update({f"{module}.{suffix}": t for suffix, t in packed.items()})
    twin[name] = value


def _mtp_tensors(
    flash: dict[str, Any], dtype: torch.dtype, layer: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """One random MTP layer in the flash names (dense): a sliding-window attention block and a dense MLP."""
    h, heads, kv = flash["hidden_size"], flash["num_attention_heads"], 2 * flash["num_key_value_heads"]
    d, dv, inter = flash["head_dim"], flash["v_head_dim"], flash["intermediate_size"]
    std = float(flash.get("initializer_range", 0.02))

    def rand(*shape: int, scale: float = std, mean: float = 0.0) -> torch.Tensor:
        return (mean + scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)

    p = f"model.mtp.layers.{layer}."
    out = {
        p + f"{norm}.weight": rand(h, scale=0.2, mean=1.0)
        for norm in ("enorm", "hnorm", "input_layernorm", "pre_mlp_layernorm", "final_layernorm")
    }
    out.update(
        {
            p + "eh_proj.weight": rand(h, 2 * h),
            p + "self_attn.q_proj.weight": rand(heads * d, h),
            p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * dv, h),
            p + "self_attn.o_proj.weight": rand(h, heads * dv),
            p + "self_attn.attention_sink_bias": rand(heads, scale=1.5),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
    )
    return out


@torch.no_grad()
def write_v26_checkpoint(
    flash_dir: str | Path,
    v26_dir: str | Path,
    twin_dir: str | Path,
    *,
    mtp_layers: int = 0,
    seed: int = 0,
    fused: bool = True,
) -> tuple[Path, Path]:
    """Write the V2.6 checkpoint and its dequantized flash-layout twin (see the module docstring). ``fused``
    False: the ``split`` projection layout, q/k/v each an FP8 matrix with its own grid."""
    flash_dir, v26_dir, twin_dir = Path(flash_dir), Path(v26_dir), Path(twin_dir)
    flash = json.loads((flash_dir / "config.json").read_text())
    tensors = load_file(str(flash_dir / "model.safetensors"))
    dtype = tensors["model.embed_tokens.weight"].dtype
    gen = torch.Generator().manual_seed(seed)
    for k in range(mtp_layers):
        tensors.update(_mtp_tensors(flash, dtype, k, gen))
    chunks = flash["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not fused and name.endswith(
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
        ):
            _packed(FP8, name, w, out, twin)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            continue  # fused with q_proj below
        elif name.endswith("self_attn.q_proj.weight"):
            prefix = name[: -len(".q_proj.weight")]
            _fuse_qkv(
                w,
                tensors[f"{prefix}.k_proj.weight"],
                tensors[f"{prefix}.v_proj.weight"],
                chunks,
                out,
                twin,
                prefix,
            )
        elif ".mlp.experts." in name:
            _packed(EXPERT_FORMAT, name, w, out, twin)
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")):
            _packed(FP8, name, w, out, twin)
        else:
            out[name] = twin[name] = w
    for i, name in enumerate(AUX_TENSORS):
        out[name] = torch.randn((8, 4 + i), generator=gen).to(dtype)
    layout = {"attention_projection_layout": "fused_qkv" if fused else "split"}
    for directory, state, config in (
        (v26_dir, out, {**v26_config(flash, mtp_layers), **layout}),
        (twin_dir, twin, flash),
    ):
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(directory / "model.safetensors"),
            metadata={"format": "pt"},
        )
        (directory / "config.json").write_text(json.dumps(config, indent=2))
    return v26_dir, twin_dir


# MiMo-V2.6-Flash (the release's own config keys: model type mimo_v2) per layer: hidden 4096, 64 q heads of 192
# (v 128), 4 KV heads on global layers and 8 on sliding-window ones (window 128 with a sink per head), 256 experts
# top-8 of 2048, no shared expert. Its 48 layers are 309B parameters (618 GB in bf16); the benchmark keeps the
# per-layer shape and runs 8: layer 0 global with the dense 16384 MLP, 1-4 sliding, 5 global, 6-7 sliding, 1-7 MoE
# (95 GB of bf16 weights), which leaves K/V and workspace room on a 141 GB H200
MIMO_V26_LAYERS = 8
_MIMO_V26_COMMON = {
    "model_type": "mimo_v2",
    "architectures": ["MiMoV2ForCausalLM"],
    "attention_projection_layout": "fused_qkv",
    "add_swa_attention_sink_bias": True,
    "add_full_attention_sink_bias": False,
    "partial_rotary_factor": 0.334,
    "attention_value_scale": 0.707,
    "layernorm_epsilon": 1e-5,
    "rope_theta": 10000000.0,
    "swa_rope_theta": 10000.0,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


def _mimo_v26_pattern(num_layers: int) -> list[int]:
    """MiMo's layout (1 = sliding window): global attention on layer 0 and every sixth layer from 5 on."""
    return [0 if i == 0 or (i + 1) % 6 == 0 else 1 for i in range(num_layers)]


MIMO_V26_BENCH: dict[str, Any] = {
    **_MIMO_V26_COMMON,
    "vocab_size": 152576,
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": MIMO_V26_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 192,
    "v_head_dim": 128,
    "swa_num_attention_heads": 64,
    "swa_num_key_value_heads": 8,
    "swa_head_dim": 192,
    "swa_v_head_dim": 128,
    "sliding_window": 128,
    "hybrid_layer_pattern": _mimo_v26_pattern(MIMO_V26_LAYERS),
    "moe_layer_freq": [0] + [1] * (MIMO_V26_LAYERS - 1),
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 1048576,
}
# the CPU smoke version of the geometry: 6 layers (0 and 5 global), window 8, 8 experts top-2
TINY_MIMO_V26_BENCH: dict[str, Any] = {
    **_MIMO_V26_COMMON,
    **{k: v for k, v in TINY_TEXT.items() if k != "rms_norm_eps"},
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "v_head_dim": 32,
    "swa_num_attention_heads": 8,
    "swa_num_key_value_heads": 4,
    "swa_head_dim": 48,
    "swa_v_head_dim": 32,
    "sliding_window": 8,
    "hybrid_layer_pattern": _mimo_v26_pattern(6),
    "moe_layer_freq": [0] + [1] * 5,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
}
