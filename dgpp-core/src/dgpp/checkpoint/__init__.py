"""Checkpoints: safetensors files or sharded index, per-parameter sources, per-rank slicing."""

from dgpp.checkpoint.loader import LoadReport, load_weights
from dgpp.checkpoint.reader import CheckpointReader
from dgpp.nn.sources import Source

__all__ = ["CheckpointReader", "LoadReport", "Source", "load_weights"]
