"""What a family offers core besides its model: tiny random checkpoints, benchmark geometries and GGUF
architecture maps, each declared by its plugin (``dgpp_tiny_checkpoints``, ``dgpp_bench_geometries``,
``dgpp_gguf_architectures``) and found by name through the plugin manager (``dgpp.catalog``).

Nothing here imports torch: a builder is imported when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinyCheckpoint:
    """A tiny random checkpoint in a release's layout, for tests and the CPU demo.

    ``build(out_dir, **options) -> Path`` writes it (config.json, safetensors) into ``out_dir`` and returns the
    directory; ``seed`` and ``dtype`` are the options every builder takes, the rest are the builder's own.
    """

    name: str
    build: Callable[..., Path]
    description: str = ""


def _same_name(name: str) -> str:
    return name


@dataclass(frozen=True)
class PackedRelease:
    """How the packed releases of a geometry store it, for ``dgpp bench --quant``: ``checkpoint_name`` maps a
    module-side tensor name to the release's (the rename the family's loader applies), and ``keep_dense`` lists
    the modules the releases leave unpacked whatever the format (``quantization_config`` ignore entries over
    checkpoint names: ``re:<regex>``, globs, dotted suffixes). Routed experts are packed whatever it lists.
    ``quantization_config``: the one the release ships, where core's scheme reads it (``--quant release``)."""

    checkpoint_name: Callable[[str], str] = _same_name
    keep_dense: tuple[str, ...] = ()
    quantization_config: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class BenchGeometry:
    """A real model's HF ``config.json`` fields, benchmarked with random weights (``dgpp bench --geometry``).

    ``build(hf_config, device, seed) -> Model``, where given, makes the random model itself (e.g. straight in a
    release's packed formats, where the dense model core would draw does not fit the device); ``hf_config`` is
    the geometry's fields with the run's dtype. Without it core draws the model (``dgpp.bench.models``).
    ``release``: the names and dense modules of its packed releases (``PackedRelease``; default: the module
    names, every decoder-layer linear packed).
    """

    name: str
    hf_config: Mapping[str, Any]
    description: str = ""
    build: Callable[[dict[str, Any], str, int], Any] | None = None
    release: PackedRelease = field(default_factory=PackedRelease)


@dataclass(frozen=True)
class GGUFArchitecture:
    """How a GGUF ``general.architecture`` maps onto an HF checkpoint the family loads.

    ``hf_config(gguf, vocab_size)`` builds config.json from the file's ``<name>.*`` metadata (``gguf`` is a
    ``dgpp.plugin_api.GGUFFile``). ``global_names`` / ``block_names`` map llama.cpp's tensor stems to HF module
    paths (the block ones inside ``model.layers.N``). ``interleaved_rows`` names the HF modules whose rows
    llama.cpp's converter interleaved per head (rotary pairs adjacent) with the config key of their head count;
    core puts them back into HF's rotate-half order.
    """

    name: str
    hf_config: Callable[[Any, int], dict[str, Any]]
    global_names: Mapping[str, str]
    block_names: Mapping[str, str]
    interleaved_rows: Mapping[str, str] = field(default_factory=dict)
