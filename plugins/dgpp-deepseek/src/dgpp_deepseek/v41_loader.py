"""DeepSeek-V4.1-Flash's own load (a model hook, as DeepSeek-V4's): the model for a ``LoadContext`` through
core's pipeline (``load_family_weights``) with the quantization the release's names resolve (FP8 E4M3 with
E8M0 scales on 32 x 32 blocks, MXFP4 routed experts; what the checkpoint stores without a ``.scale`` stays
dense: ``dgpp_deepseek.release_layout``), every parameter filled from the release's tensor names
(``dgpp_deepseek.names``; the index keys' ``wk`` / ``k_norm`` live under ``attn.indexer`` in the release and
under the kv source's compressor here). The Engram tables are not loaded: each layer maps its table from the
checkpoint file (``engine.ngram_table``: ``mmap`` reads the rows a step needs, ``resident`` copies the table
into memory once), with the token classes of the checkpoint's ``tokenizer.json``. With ``engine.mtp`` the
release's DSpark stages (``mtp.<s>.*``) are built and loaded beside the model (``with_draft_stages``)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from dgpp.plugin_api import ConfigError, LoadContext, Model, load_family_weights
from dgpp_deepseek.names import release_name
from dgpp_deepseek.release_layout import release_context, release_tensor_name
from dgpp_deepseek.v41_config import DeepseekV41ArchConfig

if TYPE_CHECKING:
    from dgpp_deepseek.v41_model import DeepseekV41ForCausalLM

_INDEX_KEYS = re.compile(r"\.attn\.compressor\.(wk|k_norm)\.")


def _structural_name(name: str) -> str:
    return _INDEX_KEYS.sub(r".attn.indexer.\1.", release_name(name))


checkpoint_name = release_tensor_name(_structural_name)


def attach_engram(model: Model, cfg: DeepseekV41ArchConfig, ctx: LoadContext) -> None:
    """Map every Engram layer's table and give it the token classes, buckets and multipliers it hashes with."""
    from dgpp.plugin_api import CheckpointReader
    from dgpp_deepseek.v41_engram import EngramTable, EngramV41, bucket_primes, token_classes

    engrams = [m for m in model.modules() if isinstance(m, EngramV41)]
    if not engrams:
        return
    tokenizer = ctx.checkpoint_dir / "tokenizer.json"
    if not tokenizer.exists():
        raise ConfigError(f"{ctx.checkpoint_dir}: Engram needs tokenizer.json for its token classes")
    classes = token_classes(tokenizer)
    if max(classes) + 1 != cfg.engram_compressed_vocab_size:
        raise ConfigError(
            f"text_config.engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}, but "
            f"{tokenizer} gives {max(classes) + 1} token classes"
        )
    primes = bucket_primes(cfg)
    file_of = CheckpointReader(ctx.checkpoint_dir).file_of
    for engram in engrams:
        layer_primes = primes[engram.position]
        rows = sum(sum(p) for p in layer_primes)
        if rows != cfg.engram_num_embeddings[engram.position]:
            raise ConfigError(
                f"text_config.engram_num_embeddings[{engram.position}]={cfg.engram_num_embeddings[engram.position]}, "
                f"but the buckets of layer {engram.layer_idx} total {rows} rows"
            )
        table = EngramTable(ctx.checkpoint_dir, f"layers.{engram.layer_idx}.engram.embed", file_of)
        if ctx.engine.ngram_table == "resident":
            table.load_into_memory()
        engram.attach(table, classes, cfg.engram_pad_token_id, layer_primes, engram.layer_idx)


def with_draft_stages(model: DeepseekV41ForCausalLM, ctx: LoadContext) -> DeepseekV41ForCausalLM:
    """``model`` with the checkpoint's DSpark stages as ``model.mtp`` when ``engine.mtp`` is on and the config
    names them (else unchanged)."""
    from dgpp_deepseek.v41_draft_stages import DSparkV41Config, build_stages
    from dgpp_deepseek.v41_dspark import text_config

    dspark = DSparkV41Config.from_text_config(text_config(ctx.hf_config), model.config)
    if ctx.engine.mtp and dspark is not None:
        model.mtp = build_stages(
            model.config, dspark, model.entry_formats, dtype=model.dtype, world=model.world
        )
    return model


def build_model(cfg: DeepseekV41ArchConfig, ctx: LoadContext) -> DeepseekV41ForCausalLM:
    """The model for ``ctx``'s engine settings (top-k, prefill mode, draft stages), its weights not filled."""
    from dgpp_deepseek.v41_model import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM(
        cfg,
        dtype=ctx.dtype,
        world=ctx.world,
        group=ctx.group,
        index_topk=ctx.engine.index_topk or None,
        bounded=ctx.engine.prefill_mode == "bounded",
    )
    return with_draft_stages(model, ctx)


def load_model(ctx: LoadContext) -> Model:
    cfg = DeepseekV41ArchConfig.from_hf_config(ctx.hf_config)
    ctx = release_context(ctx)
    model = load_family_weights(ctx, lambda: build_model(cfg, ctx), checkpoint_name)
    attach_engram(model, cfg, ctx)
    return model
