"""Build and load a Qwen model for a ``LoadContext``: parse config.json, pick the model class,
fill its parameters from the checkpoint (HF tensor names; multimodal wrappers keep the text model
under ``model.language_model.``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from dgpp.checkpoint import CheckpointReader, load_weights
from dgpp.engine.model import Model
from dgpp.errors import CheckpointError, UnsupportedModelError
from dgpp.family import LoadContext
from dgpp.quant.apply import convert_dense_weights, quantize_modules
from dgpp_qwen.config import DENSE_TYPES, HYBRID_TYPES, MOE_TYPES, QwenConfig, parse_config


def generation_eos(checkpoint_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (chat models list ``<|im_end|>`` there), if present."""
    path = checkpoint_dir / "generation_config.json"
    if not path.exists():
        return ()
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def build_model(cfg: QwenConfig, ctx: LoadContext) -> Model:
    if cfg.model_type in (*DENSE_TYPES, *MOE_TYPES):
        from dgpp_qwen.qwen3 import Qwen3ForCausalLM

        return Qwen3ForCausalLM(cfg, ctx.world, ctx.group)
    if cfg.model_type in HYBRID_TYPES:
        from dgpp_qwen.qwen3_5 import Qwen35ForCausalLM

        return Qwen35ForCausalLM(cfg, ctx.world, group=ctx.group)
    raise UnsupportedModelError(f"{ctx.architecture!r} (family Qwen) is claimed by dgpp-qwen but not yet supported")


def build_unloaded(ctx: LoadContext) -> Model:
    """The model for ``ctx.hf_config`` on ``ctx.device``, parameters uninitialised (the ``dgpp_build_model`` hook)."""
    with torch.device(ctx.device or "cpu"):
        return build_model(parse_config(ctx.hf_config), ctx).eval()


def rename_for(cfg: QwenConfig):
    """Module-side names use ``model.``; the checkpoint may nest the text model deeper."""
    if cfg.weight_prefix == "model.":
        return lambda name: name
    return lambda name: cfg.weight_prefix + name[len("model.") :] if name.startswith("model.") else name


def load_model(ctx: LoadContext) -> Model:
    if ctx.hf_config.get("model_type") in ("qwen4_exp", "qwen4_exp_text"):  # its own config and loader
        from dgpp_qwen.qwen4_exp import load_qwen4_exp

        return load_qwen4_exp(ctx)
    cfg = parse_config(ctx.hf_config)
    # chat checkpoints name their turn-end token (<|im_end|>) only in generation_config.json
    eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *generation_eos(Path(ctx.checkpoint_dir)))))
    cfg = dataclasses.replace(cfg, eos_token_ids=eos, dtype=ctx.dtype or cfg.dtype)
    reader = CheckpointReader(ctx.checkpoint_dir)
    with torch.device(ctx.device or "cpu"):
        model = build_model(cfg, ctx)
        # modules the checkpoint ships quantized get that format's packed parameters (dgpp.quant)
        quantize_modules(model, ctx.hf_config, rename=rename_for(cfg))
    load_weights(model, reader, rename=rename_for(cfg))
    reader.close()
    convert_dense_weights(model, ctx.engine)  # explicit engine.dense_weights / bf16_weights, logged
    return model.eval()
