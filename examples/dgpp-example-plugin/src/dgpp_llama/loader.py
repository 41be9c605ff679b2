"""Build and load a ``LlamaForCausalLM`` for a ``LoadContext``: parse config.json, build the model for the
rank, fill every parameter from the checkpoint by its HF name (``dgpp.checkpoint.load_weights`` names a
missing or mis-shaped tensor and its file), then apply the deployment's explicit weight options."""

from __future__ import annotations

import dataclasses

import torch

from dgpp.checkpoint import CheckpointReader, load_weights
from dgpp.checkpoint.gguf_packed import pack_gguf_weights
from dgpp.plugin_api import LoadContext
from dgpp.quant.apply import convert_dense_weights, quantize_modules
from dgpp_llama.config import parse_config
from dgpp_llama.model import LlamaForCausalLM


def load_model(ctx: LoadContext) -> LlamaForCausalLM:
    cfg = parse_config(ctx.hf_config)  # EOS from config.json; the server adds the tokenizer's stop ids
    cfg = dataclasses.replace(cfg, dtype=ctx.dtype or cfg.dtype)
    reader = CheckpointReader(ctx.checkpoint_dir)
    with torch.device(ctx.device or "cpu"):
        model = LlamaForCausalLM(cfg, ctx.world, ctx.group)
        quantize_modules(model, ctx.hf_config)  # modules a quantized release ships packed (dgpp.quant)
    load_weights(model, reader)
    reader.close()
    convert_dense_weights(model, ctx.engine)  # explicit engine.dense_weights / bf16_weights, logged
    pack_gguf_weights(model, ctx.checkpoint_dir, ctx.engine)  # explicit engine.gguf_weights, logged
    return model.eval()
