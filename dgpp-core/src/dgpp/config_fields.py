"""Typed reads of a checkpoint's ``config.json`` for family config parsers: every error names the file and key.

``ConfigFields(cfg, where)`` wraps the parsed dict; ``req`` / ``opt`` / ``positive`` read one key as a type,
with ints accepted where floats are asked for and bools refused where ints are.
"""

from __future__ import annotations

from typing import Any

from dgpp.errors import ConfigError


class ConfigFields:
    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where = cfg, where

    def fail(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def req(self, key: str, kind: type) -> Any:
        if self.cfg.get(key) is None:
            raise self.fail(f"required key {key!r} is missing")
        value = self.cfg[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
            raise self.fail(f"{key!r} must be {kind.__name__}, got {value!r}")
        return value

    def opt(self, key: str, kind: type, default: Any) -> Any:
        return default if self.cfg.get(key) is None else self.req(key, kind)

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.req(key, int) if default is None else self.opt(key, int, default)
        if value <= 0:
            raise self.fail(f"{key!r} must be positive, got {value}")
        return value
