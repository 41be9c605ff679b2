"""Deployment-template diagnostics: msgspec's errors in the template's own words, and rules between keys.

msgspec reports ``Expected `int` >= 1 - at `$.engine.kv_capacity```; a person wants
``engine.kv_capacity: out of range: expected int >= 1, got 0``. The offending value is looked up
in the raw JSON, and an unknown key gets the nearest known key as a suggestion.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import re
from typing import Any

import msgspec

from dgpp.config_schema import DeployConfig

# Per-node environment a template may set, each read by this engine; anything else is refused so tokens never travel.
NODE_ENV_ALLOWED = frozenset(
    {
        "DGPP_ROCE_DEVICES",
        "DGPP_ROCE_GID_INDICES",
        "HF_HUB_CACHE",
        "HF_HOME",
        "DGPP_LOG_LEVEL",
        "CUDA_VISIBLE_DEVICES",
    }
)

_MSG = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_PATH_TOKEN = re.compile(r"\.([A-Za-z_][A-Za-z0-9_+\-]*)|\[(\d+|\.\.\.)\]")


def _tokens(path: str) -> list[str | int]:
    out: list[str | int] = []
    for name, index in _PATH_TOKEN.findall(path):
        if name:
            out.append(name)
        elif index != "...":
            out.append(int(index))
    return out


def _dotted(tokens: list[str | int]) -> str:
    text = ""
    for t in tokens:
        text += f"[{t}]" if isinstance(t, int) else (f".{t}" if text else t)
    return text or "(top level)"


def _value_at(raw: Any, tokens: list[str | int]) -> Any:
    node = raw
    for t in tokens:
        try:
            node = node[t]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_at(schema: type, tokens: list[str | int]) -> msgspec.inspect.Type | None:
    """The msgspec type description of the key at ``tokens`` in ``schema`` (for allowed values and suggestions)."""
    node: Any = msgspec.inspect.type_info(schema)
    for t in tokens:
        node = _unwrap(node)
        if isinstance(t, int) and isinstance(node, msgspec.inspect.ListType):
            node = node.item_type
        elif isinstance(t, str) and isinstance(node, msgspec.inspect.StructType):
            match = [f for f in node.fields if f.encode_name == t]
            if not match:
                return None
            node = match[0].type
        else:
            return None
    return _unwrap(node)


def _unwrap(node: Any) -> Any:
    # "X | None" is a UnionType of X and None; the interesting part is X
    if isinstance(node, msgspec.inspect.UnionType):
        rest = [t for t in node.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return node


def _suggest(schema: type, struct_tokens: list[str | int], unknown: str) -> str:
    info = _type_at(schema, struct_tokens)
    if not isinstance(info, msgspec.inspect.StructType):
        return ""
    close = difflib.get_close_matches(unknown, [f.encode_name for f in info.fields], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def translate_validation_error(message: str, raw: Any, schema: type = DeployConfig) -> str:
    """Rewrite one msgspec ValidationError message (``raw`` converted to ``schema``) as ``<key path>: <what is wrong>``."""
    m = _MSG.match(message)
    msg, path = m.group("msg"), m.group("path") or ""
    tokens = _tokens(path)
    if msg.startswith("Object contains unknown field"):
        field = msg.split("`")[1]
        return f"{_dotted([*tokens, field])}: unknown key{_suggest(schema, tokens, field)}"
    if msg.startswith("Object missing required field"):
        field = msg.split("`")[1]
        return f"{_dotted([*tokens, field])}: required key missing"
    value = _value_at(raw, tokens)
    where = _dotted(tokens)
    if msg.startswith("Invalid enum value"):
        info = _type_at(schema, tokens)
        allowed = getattr(info, "values", None)
        hint = f" (allowed: {', '.join(map(str, allowed))})" if allowed else ""
        return f"{where}: invalid value {_short(value)}{hint}"
    expected = msg.replace("`", "")
    if ", got " in expected:  # wrong type: msgspec already names both types
        return f"{where}: wrong type: {expected[0].lower()}{expected[1:]}"
    if expected.startswith("Expected"):  # a constraint (>=, <=, length) failed on a well-typed value
        return f"{where}: out of range: {expected[0].lower()}{expected[1:]}, got {_short(value)}"
    return f"{where}: {msg}"


def _non_finite(data: Any, path: str = "") -> list[str]:
    # inf / nan pass msgspec's >= bounds (a knob can give them); they would also break the digest
    if isinstance(data, float) and not math.isfinite(data):
        return [f"{path}: {data} is not a finite number"]
    if isinstance(data, dict):
        return [p for k, v in data.items() for p in _non_finite(v, f"{path}.{k}" if path else k)]
    if isinstance(data, list):
        return [p for i, v in enumerate(data) for p in _non_finite(v, f"{path}[{i}]")]
    return []


def check_cross_keys(cfg: DeployConfig) -> list[str]:
    """Rules that involve more than one key; each problem names the keys at fault."""
    problems: list[str] = _non_finite(msgspec.to_builtins(cfg))
    if cfg.world_size is not None and cfg.nodes is not None:
        problems.append(
            "world_size, nodes: mutually exclusive (give world_size for one host, nodes for several)"
        )
    if cfg.nodes is not None and not cfg.nodes:
        problems.append("nodes: must name at least one node (rank 0 first)")
    if cfg.node_env and len(cfg.node_env) != cfg.world:
        problems.append(f"node_env: {len(cfg.node_env)} entries for {cfg.world} ranks (one object per rank)")
    for i, env in enumerate(cfg.node_env):
        for key in sorted(set(env) - NODE_ENV_ALLOWED):
            problems.append(
                f"node_env[{i}].{key}: not an allowed variable (allowed: {', '.join(sorted(NODE_ENV_ALLOWED))})"
            )
    problems += _check_http_and_ports(cfg)
    problems += _check_engine(cfg)
    return problems


def _check_http_and_ports(cfg: DeployConfig) -> list[str]:
    problems: list[str] = []
    http, ports = cfg.http, cfg.ports
    if http.bind_host != "localhost":
        try:
            ipaddress.IPv4Address(http.bind_host)
        except ValueError:
            problems.append(f"http.bind_host: {http.bind_host!r} is not an IPv4 address (or 'localhost')")
    if http.sse_ping_interval == 0:
        problems.append("http.sse_ping_interval: out of range: 0 (seconds >= 1, or -1 to disable)")
    if ports.http is not None and ports.http != http.port:
        problems.append(f"ports.http, http.port: disagree ({ports.http} vs {http.port}); give one")
    if ports.fabric == ports.journal:
        problems.append(f"ports.fabric, ports.journal: must differ (both {ports.fabric})")
    if http.port in (ports.fabric, ports.journal):
        problems.append(f"http.port: {http.port} collides with ports.fabric/ports.journal")
    return problems


def _check_engine(cfg: DeployConfig) -> list[str]:
    problems: list[str] = []
    eng = cfg.engine
    if eng.block_size & (eng.block_size - 1):
        problems.append(f"engine.block_size: {eng.block_size} is not a power of two")
    if eng.draft != "off" and eng.mtp:
        problems.append(f"engine.draft: {eng.draft!r} and engine.mtp: true both draft; choose one")
    if eng.mtp_schedule and not eng.mtp and eng.draft == "off":
        problems.append(
            "engine.mtp_schedule: true schedules the drafts of engine.mtp or engine.draft; turn one on"
        )
    if eng.dflash_model and not eng.mtp:
        problems.append("engine.dflash_model: its drafter drafts under engine.mtp; set engine.mtp: true")
    if eng.lookup_min_ngram > eng.lookup_ngram:
        problems.append(
            f"engine.lookup_min_ngram: {eng.lookup_min_ngram} exceeds engine.lookup_ngram {eng.lookup_ngram}"
        )
    busy, idle = eng.prefill_budget_tokens, eng.prefill_idle_budget_tokens
    if idle > 0 and busy > 0 and idle < busy:
        problems.append(
            f"engine.prefill_idle_budget_tokens: {idle} is below engine.prefill_budget_tokens {busy} (idle may only be larger)"
        )
    for key, on in (
        ("prefill_bf16_partials", eng.prefill_bf16_partials),
        ("prefill_fp8_gemm", eng.prefill_fp8_gemm),
    ):
        if on and eng.batch_invariant:
            problems.append(
                f"engine.{key}: engine.batch_invariant computes every row as a decode row, which the prefill "
                "levers leave alone; turn one off"
            )
    rs = eng.rope_scaling
    if rs is not None and rs.rope_type is None and rs.type is None:
        problems.append('engine.rope_scaling.rope_type: required key missing ("yarn")')
    return problems
