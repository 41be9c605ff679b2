"""Errors that carry one clear message for a person: the key, file or tensor at fault."""

from __future__ import annotations


class DgppError(Exception):
    """Base class: anything dgpp raises on purpose."""


class ConfigError(DgppError):
    """A deployment template or HF config.json value is missing, unknown, of the wrong type or out of range."""


class CheckpointError(DgppError):
    """A checkpoint is missing, or a tensor in it is missing or mis-shaped (names the tensor and the file)."""


class PluginError(DgppError):
    """Plugin discovery failed: two plugins claim one architecture, or an allow-listed plugin is absent."""


class UnsupportedModelError(DgppError):
    """No installed plugin claims the checkpoint's architecture, or it is claimed but not yet implemented."""
