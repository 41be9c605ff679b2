"""Everything a model-family plugin uses from dgpp core's contract, importable from this one module.

``dgpp.hookspecs`` documents the hooks; this module gathers the types they take and return, the helpers that
implement the shared parts of every family (declaring hooks, loading weights, the memory plan), and the errors
a plugin raises. The shared layers (``dgpp.nn``), dialect building blocks (``dgpp.text``) and test builders
(``dgpp.testing``) are libraries a family composes, imported from their own packages.

Names that pull in torch are imported on first use, so ``plugin.py`` can import this module while
``dgpp plugins`` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# the engine settings a LoadContext carries (ctx.engine); engine.rope_scaling's section under a name of its own,
# apart from the model-side dgpp.nn.rotary.RopeScaling
from dgpp.config_schema import EngineConfig
from dgpp.config_schema import RopeScaling as EngineRopeScaling
from dgpp.errors import CheckpointError, ConfigError, PluginError, UnsupportedModelError
from dgpp.family import FamilyModel, FamilySpec, LoadContext, World
from dgpp.family_contract import Family
from dgpp.hookspecs import PluginHooks, hookimpl
from dgpp.offers import BenchGeometry, GGUFArchitecture, PackedRelease, TinyCheckpoint

if TYPE_CHECKING:
    from dgpp.bench.models import fill_random
    from dgpp.bench.step_bytes import kv_bytes_per_token, state_bytes_per_request
    from dgpp.checkpoint import CheckpointReader
    from dgpp.checkpoint.config_keys import CausalLMFields, ConfigKeys
    from dgpp.checkpoint.dtypes import COMPUTE_DTYPES
    from dgpp.checkpoint.gguf_file import GGUFFile
    from dgpp.checkpoint.headers import tensor_bytes
    from dgpp.checkpoint.loader import load_weights
    from dgpp.media.prompt import ImageError, ImageInput, ProcessedImage, PromptImage, PromptMedia
    from dgpp.quant.apply import quantize_modules
    from dgpp.quant.format import QuantFormat
    from dgpp.quant.scheme import QuantScheme
    from dgpp.startup.loading import load_model
    from dgpp.startup.memory_estimate import estimate_model_memory
    from dgpp.startup.weights import checkpoint_tensor_names, load_family_weights, settle_weights
    from dgpp.step.batch import ForwardBatch
    from dgpp.step.cache_spec import (
        CacheSpec,
        CompressedKV,
        LatentKV,
        PagedKV,
        StateSpec,
        WindowBuffer,
        WindowKV,
        stored_as,
    )
    from dgpp.step.memory import MemoryPlan, ModelMemory, transformer_activation_bytes
    from dgpp.step.model import BlockDrafter, Drafter, Model, ModelInfo, collect_cache_entries
    from dgpp.text.dialect import Dialect

# name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "fill_random": "dgpp.bench.models",
    "kv_bytes_per_token": "dgpp.bench.step_bytes",
    "state_bytes_per_request": "dgpp.bench.step_bytes",
    "CheckpointReader": "dgpp.checkpoint",
    "ConfigKeys": "dgpp.checkpoint.config_keys",
    "CausalLMFields": "dgpp.checkpoint.config_keys",
    "COMPUTE_DTYPES": "dgpp.checkpoint.dtypes",
    "tensor_bytes": "dgpp.checkpoint.headers",
    "load_weights": "dgpp.checkpoint.loader",
    "GGUFFile": "dgpp.checkpoint.gguf_file",
    "ImageError": "dgpp.media.prompt",
    "ImageInput": "dgpp.media.prompt",
    "ProcessedImage": "dgpp.media.prompt",
    "PromptImage": "dgpp.media.prompt",
    "PromptMedia": "dgpp.media.prompt",
    "ForwardBatch": "dgpp.step.batch",
    "CacheSpec": "dgpp.step.cache_spec",
    "LatentKV": "dgpp.step.cache_spec",
    "WindowKV": "dgpp.step.cache_spec",
    "CompressedKV": "dgpp.step.cache_spec",
    "WindowBuffer": "dgpp.step.cache_spec",
    "PagedKV": "dgpp.step.cache_spec",
    "StateSpec": "dgpp.step.cache_spec",
    "stored_as": "dgpp.step.cache_spec",
    "MemoryPlan": "dgpp.step.memory",
    "ModelMemory": "dgpp.step.memory",
    "transformer_activation_bytes": "dgpp.step.memory",
    "BlockDrafter": "dgpp.step.model",
    "Drafter": "dgpp.step.model",
    "Model": "dgpp.step.model",
    "collect_cache_entries": "dgpp.step.model",
    "ModelInfo": "dgpp.step.model",
    "checkpoint_tensor_names": "dgpp.startup.weights",
    "load_family_weights": "dgpp.startup.weights",
    "settle_weights": "dgpp.startup.weights",
    "quantize_modules": "dgpp.quant.apply",
    "QuantFormat": "dgpp.quant.format",
    "QuantScheme": "dgpp.quant.scheme",
    "Dialect": "dgpp.text.dialect",
    "load_model": "dgpp.startup.loading",
    "estimate_model_memory": "dgpp.startup.memory_estimate",
}

__all__ = [
    "fill_random",
    "kv_bytes_per_token",
    "state_bytes_per_request",
    "COMPUTE_DTYPES",
    "BenchGeometry",
    "BlockDrafter",
    "CacheSpec",
    "CausalLMFields",
    "CheckpointError",
    "CompressedKV",
    "CheckpointReader",
    "ConfigError",
    "PackedRelease",
    "ConfigKeys",
    "Dialect",
    "Drafter",
    "EngineConfig",
    "EngineRopeScaling",
    "Family",
    "FamilyModel",
    "FamilySpec",
    "ForwardBatch",
    "GGUFArchitecture",
    "GGUFFile",
    "ImageError",
    "ImageInput",
    "LatentKV",
    "WindowKV",
    "WindowBuffer",
    "LoadContext",
    "MemoryPlan",
    "Model",
    "ModelInfo",
    "ModelMemory",
    "PagedKV",
    "PluginError",
    "PluginHooks",
    "ProcessedImage",
    "PromptImage",
    "PromptMedia",
    "QuantFormat",
    "QuantScheme",
    "StateSpec",
    "TinyCheckpoint",
    "UnsupportedModelError",
    "World",
    "checkpoint_tensor_names",
    "collect_cache_entries",
    "hookimpl",
    "load_family_weights",
    "load_model",
    "load_weights",
    "estimate_model_memory",
    "quantize_modules",
    "settle_weights",
    "stored_as",
    "tensor_bytes",
    "transformer_activation_bytes",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
