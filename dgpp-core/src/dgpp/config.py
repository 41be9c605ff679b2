"""Deployment templates: loading, knob overrides and validation into a ``DeployConfig``.

A template is JSON; its keys follow the original engine's deployment templates (github.com/HawkBearPig/dgpp)
where this engine builds what they ask for. Unknown keys, wrong types and out-of-range values are refused
with one ``ConfigError`` naming the key's path (``engine.max_concurency: unknown key``), and so are the
original engine's keys this one does not build, with the reason (``dgpp.config_refused``). The schema
(keys, types, ranges, the one default of each key) is ``dgpp.config_schema``, re-exported here; rules
between keys are in ``dgpp.config_checks``. Every key, default and range is documented in
docs/configuration.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from dgpp.config_checks import check_cross_keys, translate_validation_error
from dgpp.config_refused import not_built
from dgpp.config_schema import (
    DeployConfig,
    EngineConfig,
    HttpConfig,
    PortsConfig,
    RopeScaling,
    canonical_json,
    fnv1a64_hex,
)
from dgpp.errors import ConfigError

__all__ = [
    "KNOB_KEYS",
    "REFUSED_KNOBS",
    "DeployConfig",
    "EngineConfig",
    "HttpConfig",
    "PortsConfig",
    "RopeScaling",
    "apply_knobs",
    "canonical_json",
    "fnv1a64_hex",
    "load_config",
    "parse_config",
    "read_template",
]

# Knobs: the engine keys a command line may override on a template (``--knobs`` or one flag each).
# Topology and model flags are refused: they change which ranks exist or which weights load.
KNOB_KEYS: dict[str, tuple[str, ...]] = {
    "max_concurrency": ("engine", "max_concurrency"),
    "kv_capacity": ("engine", "kv_capacity"),
    "mtp": ("engine", "mtp"),
    "mtp_depth": ("engine", "mtp_depth"),
    "draft": ("engine", "draft"),
    "draft_depth": ("engine", "draft_depth"),
    "kv_dtype": ("engine", "kv_dtype"),
    "dtype": ("engine", "dtype"),
    "prefix_cache_gib": ("engine", "prefix_cache_gib"),
    "dense_weights": ("engine", "dense_weights"),
    "bf16_weights": ("engine", "bf16_weights"),
    "gguf_weights": ("engine", "gguf_weights"),
    "port": ("http", "port"),
    "host": ("http", "bind_host"),
}
REFUSED_KNOBS = ("model", "world_size", "nodes")


def apply_knobs(raw: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of the raw template with knob values written at their keys (validated later, like the file)."""
    out = json.loads(json.dumps(raw))
    for name, value in knobs.items():
        if name in REFUSED_KNOBS:
            raise ConfigError(
                f"--{name.replace('_', '-')}: {name} is a topology/model key; edit the template instead"
            )
        if name not in KNOB_KEYS:
            raise ConfigError(
                f"--{name.replace('_', '-')}: not a knob (knobs: {', '.join(sorted(KNOB_KEYS))})"
            )
        section, key = KNOB_KEYS[name]
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: expected object, got {type(target).__name__}")
        target[key] = value
        ports = out.get("ports")
        if name == "port" and isinstance(ports, dict) and "http" in ports:
            ports["http"] = value  # the template may spell the HTTP port in both places; move both
    return out


def parse_config(raw: Any, source: str = "<config>") -> DeployConfig:
    """Validate plain JSON data as a deployment; every failure is one ConfigError naming the key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a deployment template must be a JSON object, got {type(raw).__name__}")
    refused = not_built(raw)
    if refused:
        raise ConfigError(f"{source}: " + "; ".join(refused))
    try:
        cfg = msgspec.convert(raw, DeployConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {translate_validation_error(str(exc), raw, DeployConfig)}") from None
    problems = check_cross_keys(cfg)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    # fill derived values so the effective config (and its digest) does not depend on how it was spelt
    if cfg.ports.http is None:
        cfg.ports.http = cfg.http.port
    if cfg.nodes is None and cfg.world_size is None:
        cfg.world_size = 1
    return cfg


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_template(path: str | Path) -> Any:
    """Read a template file as JSON data, naming the file (and line) when it cannot be read."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: deployment template not found") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read deployment template ({exc.strerror})") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant)  # NaN / Infinity are not JSON
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:
        raise ConfigError(f"{p}: not valid JSON: {exc}") from None


def load_config(path: str | Path, knobs: dict[str, Any] | None = None) -> DeployConfig:
    """Read, apply command-line knobs, and validate a deployment template."""
    raw = read_template(path)
    if knobs:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a deployment template must be a JSON object")
        raw = apply_knobs(raw, knobs)
    return parse_config(raw, source=str(path))
