"""The format registry: core's built-ins plus whatever plugins add through ``dgpp_quant_formats``."""

from __future__ import annotations

from functools import lru_cache

from dgpp.errors import ConfigError
from dgpp.quant.builtin_formats import builtin_formats
from dgpp.quant.format import QuantFormat


@lru_cache(maxsize=1)
def registered_formats() -> dict[str, QuantFormat]:
    """Every format answered by the ``dgpp_quant_formats`` hook, by name (first registration wins)."""
    from dgpp.plugins import manager

    out: dict[str, QuantFormat] = {}
    for answer in manager().hook.dgpp_quant_formats():
        for fmt in answer or ():
            out.setdefault(fmt.name, fmt)
    for fmt in builtin_formats():  # available even when the plugin manager is built without core
        out.setdefault(fmt.name, fmt)
    return out


def get_format(name: str, **params) -> QuantFormat:
    """The registered format ``name`` configured with ``params`` (e.g. ``block=(128, 128)``)."""
    try:
        proto = registered_formats()[name]
    except KeyError:
        known = ", ".join(sorted(registered_formats()))
        raise ConfigError(f"unknown weight format {name!r} (known: {known})") from None
    return proto.with_params(**params) if params else proto
