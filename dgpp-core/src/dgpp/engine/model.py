"""The model contract where the engine imports it from (defined in ``dgpp.step.model``, below the plugin
contract that returns it)."""

from __future__ import annotations

from dgpp.step.model import Drafter, Model, ModelInfo

__all__ = ["Drafter", "Model", "ModelInfo"]
