"""dgpp: an LLM inference engine; the model families are pluggy plugins."""

from __future__ import annotations

__version__ = "0.1.0"
