"""A DFlash2 drafter checkpoint (``DFlash2DraftModel``, e.g. z-lab/Qwen3.8-27B-DFlash2): its ``config.json``
parsed and checked against the target, and its tensors read by name from the directory ``engine.dflash_model``
names. Every refusal names the file and the key or tensor at fault."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dgpp.plugin_api import CheckpointError, ConfigError

KEY = "engine.dflash_model"


@dataclass(frozen=True)
class DFlash2Config:
    """The drafter's geometry: Qwen3 layers (``num_hidden_layers`` of them) plus the ``dflash_config`` keys."""

    # query rows per block: the last accepted token, then ``block_size - 1`` mask rows (the drafts)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # the target layers whose outputs feed ``fc`` (sorted)
    conv_taps: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int | None  # None: the context is not windowed

    @property
    def drafts(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_dir(cls, directory: Path) -> DFlash2Config:
        path = directory / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{KEY}: {directory} has no config.json (a DFlash2 drafter checkpoint)")
        try:
            raw = json.loads(path.read_text())
        except ValueError as e:
            raise CheckpointError(f"{path}: not JSON ({e})") from e
        return cls.parse(raw, path)

    @classmethod
    def parse(cls, raw: dict[str, Any], path: Path) -> DFlash2Config:
        def reject(key: str, why: str) -> CheckpointError:
            return CheckpointError(f"{path}: {key!r} {why}")

        def number(where: dict[str, Any], key: str, default: Any = None, prefix: str = "") -> Any:
            value = where.get(key, default)
            if value is None:
                raise reject(prefix + key, "is missing")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise reject(prefix + key, f"must be a number, got {value!r}")
            return value

        arch = (raw.get("architectures") or [""])[0]
        if arch != "DFlash2DraftModel":
            raise reject("architectures", f"must name DFlash2DraftModel, got {arch!r}")
        d = raw.get("dflash_config")
        if not isinstance(d, dict):
            raise reject("dflash_config", "is missing")
        dp = "dflash_config."
        if d.get("causal") or raw.get("is_causal"):
            raise reject(dp + "causal", "must be false: DFlash2 blocks are bidirectional")
        taps = d.get("target_layer_ids")
        if not isinstance(taps, list) or not taps or not all(isinstance(t, int) for t in taps):
            raise reject(dp + "target_layer_ids", f"must list target layers, got {taps!r}")
        if len(set(taps)) != len(taps):
            raise reject(dp + "target_layer_ids", f"lists a layer twice: {taps!r}")
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise reject("rope_parameters.rope_type", "must be 'default'")
        heads = number(raw, "num_attention_heads")
        sliding = raw.get("use_sliding_window", True)
        cfg = cls(
            block_size=number(d, "block_size", prefix=dp),
            mask_token_id=number(d, "mask_token_id", prefix=dp),
            target_layer_ids=tuple(sorted(taps)),
            conv_taps=number(d, "conv_kernel_size", 2, dp),
            conv_group_size=number(d, "conv_group_size", 16, dp),
            selector_rank=number(d, "selector_rank", prefix=dp),
            selector_top_k=number(d, "selector_top_k", prefix=dp),
            num_hidden_layers=number(raw, "num_hidden_layers"),
            hidden_size=number(raw, "hidden_size"),
            vocab_size=number(raw, "vocab_size"),
            num_attention_heads=heads,
            num_key_value_heads=number(raw, "num_key_value_heads"),
            head_dim=number(raw, "head_dim", raw.get("hidden_size", 0) // max(heads, 1)),
            intermediate_size=number(raw, "intermediate_size"),
            rms_norm_eps=float(number(raw, "rms_norm_eps", 1e-6)),
            rope_theta=float(number(rope, "rope_theta", raw.get("rope_theta", 1e7), "rope_parameters.")),
            sliding_window=number(raw, "sliding_window") if sliding else None,
        )
        if cfg.block_size < 2:
            raise reject(dp + "block_size", f"must be at least 2, got {cfg.block_size}")
        if cfg.hidden_size % cfg.conv_group_size:
            raise reject(dp + "conv_group_size", f"must divide hidden_size {cfg.hidden_size}")
        if cfg.conv_taps < 1 or cfg.selector_top_k < 1 or cfg.selector_rank < 1:
            raise reject(dp + "conv_kernel_size", "and the selector's rank and top_k must be positive")
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise reject("num_key_value_heads", f"must divide num_attention_heads {cfg.num_attention_heads}")
        if cfg.sliding_window is not None and cfg.sliding_window <= cfg.block_size:
            raise reject("sliding_window", f"must cover the block of {cfg.block_size} rows")
        return cfg

    def check_target(self, hidden_size: int, vocab_size: int, layers: int, path: Path) -> None:
        """The drafter shares the target's width, vocabulary, embedding and head, and taps its layers."""
        where = path / "config.json"
        if self.hidden_size != hidden_size:
            raise CheckpointError(
                f"{where}: 'hidden_size' {self.hidden_size} is not the target's {hidden_size}"
            )
        if self.vocab_size != vocab_size:
            raise CheckpointError(f"{where}: 'vocab_size' {self.vocab_size} is not the target's {vocab_size}")
        if not 0 <= self.mask_token_id < vocab_size:
            raise CheckpointError(
                f"{where}: 'dflash_config.mask_token_id' {self.mask_token_id} is outside the vocabulary"
            )
        if not 0 <= self.selector_top_k <= vocab_size:
            raise CheckpointError(f"{where}: 'dflash_config.selector_top_k' exceeds the vocabulary")
        bad = [t for t in self.target_layer_ids if not 0 <= t < layers]
        if bad:
            raise CheckpointError(
                f"{where}: 'dflash_config.target_layer_ids' {bad} are not layers of the target (0..{layers - 1})"
            )


def drafter_dir(value: str) -> Path:
    """The directory ``engine.dflash_model`` names (a ``ConfigError`` naming the key when it is not one)."""
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{KEY}: {value!r} is not a directory (a DFlash2 drafter checkpoint)")
    return path


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's ``*.safetensors`` shards by name."""
    from safetensors.torch import load_file

    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{KEY}: {directory} has no .safetensors shards")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(shard))
    return tensors
