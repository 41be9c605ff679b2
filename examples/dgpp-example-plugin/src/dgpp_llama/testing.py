"""The Llama family's tiny random checkpoint, offered to core (``dgpp_tiny_checkpoints``) as ``llama``: the tests'
``dgpp.testing.builders.build_tiny_checkpoint("llama", dir)`` finds it through the plugin manager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgpp.plugin_api import TinyCheckpoint
from dgpp.testing.builders import build_transformers_checkpoint


def build_tiny_llama(out_dir: str | Path, **options: Any) -> Path:
    """A tiny random ``LlamaForCausalLM`` (``dgpp.testing.builders.TINY_TEXT``) saved by transformers."""
    return build_transformers_checkpoint("LlamaConfig", "LlamaForCausalLM", out_dir, **options)


def tiny_checkpoints() -> list[TinyCheckpoint]:
    return [TinyCheckpoint("llama", build_tiny_llama, "transformers' LlamaForCausalLM")]
