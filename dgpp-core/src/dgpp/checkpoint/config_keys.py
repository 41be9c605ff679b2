"""Typed reads of an HF ``config.json`` for a family's config parser: each failure is one ``ConfigError`` that
names the file's kind and the key (``ConfigKeys(cfg, "flint config.json").positive("hidden_size")``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dgpp.checkpoint.dtypes import COMPUTE_DTYPES
from dgpp.errors import ConfigError
from dgpp.nn.rotary import ROPE_TYPES, RopeScaling, YarnScaling


@dataclass(frozen=True, kw_only=True)
class CausalLMFields:
    """What every causal LM's typed config carries beside its architecture (``ModelInfo`` and
    ``dgpp.nn.decoder`` read them); a family's config subclasses it and fills it from
    ``ConfigKeys.causal_lm_fields``."""

    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None


class ConfigKeys:
    """``cfg`` (config.json as a dict) read key by key; ``where`` opens every error message, and ``prefix`` names
    where ``cfg`` sits in the file (``"text_config."`` for a multimodal wrapper's text model)."""

    def __init__(self, cfg: dict[str, Any], where: str, prefix: str = "") -> None:
        self.cfg = cfg
        self.where = where
        self.prefix = prefix

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def name(self, key: str) -> str:
        """``key`` as an error message quotes it: ``'text_config.hidden_size'``."""
        return repr(f"{self.prefix}{key}")

    def required(self, key: str, kind: type) -> Any:
        """The value of ``key`` as ``kind`` (an int is accepted as a float; a bool is never an int)."""
        if self.cfg.get(key) is None:
            raise self.error(f"required key {self.name(key)} is missing")
        value = self.cfg[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise self.error(f"{self.name(key)} must be {kind.__name__}, got {value!r}")
        return value

    def optional(self, key: str, kind: type, default: Any) -> Any:
        """``default`` when ``key`` is absent or null, else as :meth:`required`."""
        return default if self.cfg.get(key) is None else self.required(key, kind)

    def positive(self, key: str, default: int | None = None) -> int:
        """A positive int; required unless a ``default`` is given."""
        value = self.required(key, int) if default is None else self.optional(key, int, default)
        if value <= 0:
            raise self.error(f"{self.name(key)} must be positive, got {value}")
        return value

    def dtype(self, default: str = "bfloat16") -> torch.dtype:
        """The checkpoint dtype (``dtype``, or the older ``torch_dtype``)."""
        name = (
            self.cfg.get("dtype") or self.cfg.get("torch_dtype") or default
        )  # a null dtype defers to torch_dtype
        if name not in COMPUTE_DTYPES:
            raise self.error(f"'torch_dtype'={name!r} is not supported ({', '.join(COMPUTE_DTYPES)})")
        return COMPUTE_DTYPES[name]

    def token_ids(self, key: str) -> tuple[int, ...]:
        """An id or a list of ids (``eos_token_id``) as a tuple; () when absent."""
        value = self.cfg.get(key)
        return () if value is None else tuple(value) if isinstance(value, list) else (int(value),)

    def only(self, key: str, supported: str) -> None:
        """Refuse any value of ``key`` but ``supported``, which an absent key means (``hidden_act``: SiLU)."""
        value = self.cfg.get(key, supported)
        if value != supported:
            raise self.error(f"{self.name(key)}={value!r} is not supported (only {supported!r})")

    def rope(
        self,
        supported: tuple[str, ...] = ROPE_TYPES,
        *,
        section: str | None = None,
        default_theta: float | None = None,
        original_fallback: bool = True,
    ) -> RopeScaling:
        """The RoPE of ``rope_parameters`` (transformers >= 5) or of top-level ``rope_theta`` + ``rope_scaling``
        (older configs), as transformers reads it; a ``rope_type`` outside ``supported`` is refused by key.

        ``section`` reads one entry of ``rope_parameters`` (a RoPE per layer type: MiMo's ``full_attention``,
        DeepSeek-V4's ``compress``); ``default_theta`` is the theta where the block names none (else the top-level
        ``rope_theta``, else 10000); ``original_fallback=False`` makes a YaRN block name its own
        ``original_max_position_embeddings`` instead of taking ``max_position_embeddings``."""
        if section is not None:
            params, where = self.rope_section(section), f"rope_parameters.{section}."
        elif isinstance(self.cfg.get("rope_parameters"), dict):
            params, where = dict(self.cfg["rope_parameters"]), "rope_parameters."
        else:
            scaling = self.cfg.get("rope_scaling")
            if scaling is not None and not isinstance(scaling, dict):
                raise self.error("'rope_scaling' must be an object or null")
            params, where = dict(scaling or {}), "rope_scaling."
        # a top-level theta where none is nested
        params.setdefault(
            "rope_theta", self.cfg.get("rope_theta", 10000.0) if default_theta is None else default_theta
        )
        type_key = "rope_type" if "rope_type" in params else "type"
        rope_type = params.get(type_key, "default")
        if rope_type not in supported:
            raise self.error(
                f"{self.name(where + type_key)}={rope_type!r} is not supported ({', '.join(supported)})"
            )
        keys = ConfigKeys(params, f"{self.where}: {self.prefix}{where.rstrip('.')}")
        theta = keys.optional("rope_theta", float, 10000.0)
        if theta <= 0:
            raise keys.error(f"'rope_theta' must be a positive number, got {theta!r}")
        if rope_type == "default":
            return RopeScaling(theta=theta)
        factor = keys.required("factor", float)
        if rope_type == "linear":
            return RopeScaling(theta=theta, rope_type=rope_type, factor=factor)
        if rope_type == "llama3":
            return RopeScaling(
                theta=theta,
                rope_type=rope_type,
                factor=factor,
                low_freq_factor=keys.required("low_freq_factor", float),
                high_freq_factor=keys.required("high_freq_factor", float),
                original_max_position=keys.required("original_max_position_embeddings", int),
            )
        fallback = self.cfg.get("max_position_embeddings") if original_fallback else None
        original = keys.optional("original_max_position_embeddings", int, fallback)
        if original is None:
            raise keys.error("required key 'original_max_position_embeddings' is missing")
        optional = {
            k: keys.optional(k, float, None) for k in ("attention_factor", "mscale", "mscale_all_dim")
        }
        yarn = YarnScaling(
            factor=factor,
            original_max_position=original,
            beta_fast=keys.optional("beta_fast", float, 32.0),
            beta_slow=keys.optional("beta_slow", float, 1.0),
            truncate=keys.optional("truncate", bool, True),
            **optional,
        )
        return RopeScaling(
            theta=theta, rope_type=rope_type, factor=factor, original_max_position=original, yarn=yarn
        )

    def rope_section(self, name: str) -> dict[str, Any]:
        """``rope_parameters[name]``, a RoPE block of its own; refused by key when absent."""
        params = self.cfg.get("rope_parameters")
        entry = params.get(name) if isinstance(params, dict) else None
        if not isinstance(entry, dict):
            raise self.error(
                f"{self.name('rope_parameters')} must hold an entry for {name!r}, got {params!r}"
            )
        return dict(entry)

    def rotary_dim(self, head_dim: int, default_factor: float = 1.0, *, section: str | None = None) -> int:
        """The dims of each head RoPE rotates: ``int(head_dim * partial_rotary_factor)`` (transformers' rounding),
        the factor read from ``rope_parameters`` (its ``section`` entry when given) or the top level; it must give
        an even, non-zero width."""
        params = self.rope_section(section) if section is not None else self.cfg.get("rope_parameters")
        factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
        factor = self.cfg.get("partial_rotary_factor", default_factor) if factor is None else factor
        name = self.name(
            "partial_rotary_factor" if section is None else f"rope_parameters.{section}.partial_rotary_factor"
        )
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1:
            raise self.error(f"{name} must be in (0, 1], got {factor!r}")
        rotary = int(head_dim * factor)
        if rotary % 2 or rotary == 0:
            raise self.error(
                f"{name}={factor} gives an odd or empty rotary dim {rotary} of head_dim {head_dim}"
            )
        return rotary

    def causal_lm_fields(self, max_position: int, bos_token_id: int | None = None) -> dict[str, Any]:
        """``CausalLMFields``' values; ``max_position`` and ``bos_token_id`` are the defaults for absent keys."""
        return {
            "max_position_embeddings": self.positive("max_position_embeddings", max_position),
            "tie_word_embeddings": self.optional("tie_word_embeddings", bool, False),
            "dtype": self.dtype(),
            "eos_token_ids": self.token_ids("eos_token_id"),
            "bos_token_id": self.cfg.get("bos_token_id", bos_token_id),
        }
