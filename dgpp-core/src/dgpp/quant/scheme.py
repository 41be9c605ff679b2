"""Which format each module is in: ``quantization_config`` of an HF config.json, resolved per module.

Supported ``quant_method`` values: ``fp8`` (block-scaled E4M3; ``scale_fmt: ue8m0`` for E8M0 scales;
``expert_dtype: fp4`` for routed experts in MXFP4, as DeepSeek-V4 / V4.1 ship them),
``modelopt`` (``quant_algo: NVFP4``), ``compressed-tensors`` (``config_groups`` with ``targets`` /
``ignore``: NVFP4, FP8 channel or block, symmetric pack-quantized int4/int8), ``gptq`` and ``auto-round``
(GPTQ layout, with per-module ``dynamic`` / ``extra_config`` overrides), ``dgpp_nf4i8`` (full GLM-5.3's NF4I8
re-encoding), ``dgpp_mixed`` (GLM-5.3-Flash's NVFP4 routed experts beside FP8 blocks). Anything else is a
``ConfigError`` naming the key. Resolution order: ignore list first, then the first matching group.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from dgpp.errors import ConfigError
from dgpp.quant.codebook import NF4I8_LEVELS, ROTATION_BLOCK, NF4Codebook
from dgpp.quant.format import QuantFormat
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked

KEY = "quantization_config"


def _matches(pattern: str, name: str) -> bool:
    """A module name against an ignore/target entry: ``re:<regex>``, a glob, an exact name or a dotted suffix."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern) or name.startswith(pattern + ".")


@dataclass
class QuantScheme:
    """Resolved ``quantization_config``: ``format_for(module)`` -> the module's format or None (dense)."""

    method: str
    ignore: list[str] = field(default_factory=list)
    groups: list[tuple[list[str], QuantFormat]] = field(default_factory=list)
    overrides: list[tuple[str, QuantFormat | None]] = field(default_factory=list)
    act_order: bool = False  # GPTQ desc_act: modules carry a permuted g_idx

    def format_for(self, module: str) -> QuantFormat | None:
        for pattern, fmt in self.overrides:
            if _matches(pattern, module):
                return fmt
        if any(_matches(p, module) for p in self.ignore):
            return None
        for targets, fmt in self.groups:
            if any(t == "Linear" or _matches(t, module) for t in targets):
                return fmt
        return None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> QuantScheme | None:
        qc = hf_config.get(KEY)
        if qc is None:
            text = hf_config.get("text_config")
            qc = text.get(KEY) if isinstance(text, dict) else None
        if qc is None:
            return None
        if not isinstance(qc, dict):
            raise ConfigError(f"{KEY}: expected an object, got {type(qc).__name__}")
        if "expert_dtype" in hf_config and "expert_dtype" not in qc:  # DeepSeek-V4 ships it at the top level
            qc = {**qc, "expert_dtype": hf_config["expert_dtype"]}
        method = str(qc.get("quant_method", "")).lower()
        parser = _PARSERS.get(method)
        if parser is None:
            raise ConfigError(
                f"{KEY}.quant_method: {method!r} is not supported (supported: {', '.join(sorted(_PARSERS))})"
            )
        return parser(qc)


def _fp8(qc: dict) -> QuantScheme:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{KEY}.fmt: {qc.get('fmt')!r} is not supported (only e4m3)")
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise ConfigError(
            f"{KEY}.weight_block_size: per-tensor FP8 is not supported; a [rows, cols] block is required"
        )
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"{KEY}.scale_fmt: {scale_fmt!r} is not supported (float or ue8m0)")
    fmt = FP8Block(
        block=(int(block[0]), int(block[1])), scale_format="e8m0" if scale_fmt == "ue8m0" else "f32"
    )
    ignore = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
    return QuantScheme("fp8", ignore=ignore, groups=[(["Linear"], fmt)], overrides=_expert_dtype(qc))


# a routed expert's projection: ``...experts.<id>.<proj>`` (not ``shared_experts``)
ROUTED_EXPERT = r"re:(.*\.)?experts\.\d+\.[^.]+$"


def _expert_dtype(qc: dict) -> list[tuple[str, QuantFormat | None]]:
    """``expert_dtype`` (DeepSeek-V4's key; transformers moves a top-level one into ``quantization_config``):
    ``fp8`` keeps the experts in the block format, ``fp4`` ships them as MXFP4 (E2M1 pairs in one byte, an
    E8M0 exponent per 32 inputs, ``weight`` and ``weight_scale``), whatever the dense block size."""
    kind = qc.get("expert_dtype") or "fp8"
    if kind == "fp8":
        return []
    if kind == "fp4":
        return [(ROUTED_EXPERT, MXFP4())]
    raise ConfigError(f"{KEY}.expert_dtype: {kind!r} is not supported (fp8 or fp4)")


def _modelopt(qc: dict) -> QuantScheme:
    inner = qc.get("quantization", qc)
    algo = str(inner.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise ConfigError(f"{KEY}.quant_algo: {algo!r} is not supported for modelopt (only NVFP4)")
    group = int(inner.get("group_size", 16))
    if group != 16:
        raise ConfigError(f"{KEY}.group_size: NVFP4 uses groups of 16, got {group}")
    ignore = list(inner.get("exclude_modules") or []) + list(qc.get("ignore") or [])
    return QuantScheme("modelopt", ignore=ignore, groups=[(["Linear"], NVFP4ModelOpt())])


def _ct_weights(name: str, weights: dict, pack_format: str) -> QuantFormat:
    where = f"{KEY}.config_groups.{name}.weights"
    kind, bits, strategy = weights.get("type"), int(weights.get("num_bits", 0)), weights.get("strategy")
    if weights.get("actorder"):
        raise ConfigError(f"{where}.actorder: activation ordering is not supported for compressed-tensors")
    if (
        kind == "float"
        and bits == 4
        and strategy == "tensor_group"
        and int(weights.get("group_size") or 0) == 16
    ):
        return NVFP4CompressedTensors()
    if kind == "float" and bits == 4 and strategy == "group" and int(weights.get("group_size") or 0) == 32:
        return MXFP4(data_name="weight_packed")
    if kind == "float" and bits == 8 and strategy == "channel":
        return FP8Channel()
    if kind == "float" and bits == 8 and strategy == "block":
        block = weights.get("block_structure") or [128, 128]
        return FP8Block(block=(int(block[0]), int(block[1])), scale_name="weight_scale")
    if kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
        if not weights.get("symmetric", True):
            raise ConfigError(f"{where}.symmetric: asymmetric int weights (zero points) are not supported")
        if pack_format != "pack-quantized":
            raise ConfigError(f"{KEY}.format: int weights must be 'pack-quantized', got {pack_format!r}")
        group = int(weights.get("group_size") or 0) if strategy == "group" else 0
        return IntPacked(bits=bits, group=group)
    raise ConfigError(
        f"{where}: type={kind} num_bits={bits} strategy={strategy} is not a supported weight scheme"
    )


def _compressed_tensors(qc: dict) -> QuantScheme:
    groups_cfg = qc.get("config_groups")
    if not isinstance(groups_cfg, dict) or not groups_cfg:
        raise ConfigError(f"{KEY}.config_groups: missing or empty")
    groups = []
    for name, group in groups_cfg.items():
        weights = group.get("weights")
        if not weights:
            raise ConfigError(
                f"{KEY}.config_groups.{name}.weights: missing (activation-only schemes are not supported)"
            )
        fmt = _ct_weights(name, weights, group.get("format") or qc.get("format") or "")
        groups.append((list(group.get("targets") or []), fmt))
    return QuantScheme("compressed-tensors", ignore=list(qc.get("ignore") or []), groups=groups)


def _gptq_format(bits: int, group: int, zero_offset: int, where: str) -> GPTQ:
    if bits not in (4, 8):
        raise ConfigError(f"{where}.bits: {bits}-bit GPTQ is not supported (4 or 8)")
    return GPTQ(bits=bits, group=group, zero_offset=zero_offset)


def _gptq(qc: dict) -> QuantScheme:
    method = str(qc.get("quant_method")).lower()
    if method == "gptq":
        ckpt = qc.get("checkpoint_format", "gptq")
        if ckpt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"{KEY}.checkpoint_format: {ckpt!r} is not supported (gptq or gptq_v2)")
        zero_offset = 1 if ckpt == "gptq" else 0
    else:
        packing = str(qc.get("packing_format", "auto_round:auto_gptq"))
        if "gptq" not in packing:
            raise ConfigError(f"{KEY}.packing_format: {packing!r} is not supported (GPTQ layouts only)")
        zero_offset = 1
    # asymmetric checkpoints need nothing extra: qzeros are read either way
    base = _gptq_format(int(qc.get("bits", 4)), int(qc.get("group_size", 128)), zero_offset, KEY)
    overrides: list[tuple[str, QuantFormat | None]] = []
    for pattern, over in (qc.get("dynamic") or {}).items():  # GPTQModel: "-:regex" skip, "+:regex" override
        if pattern.startswith("-:"):
            overrides.append(("re:" + pattern[2:], None))
        else:
            regex = pattern[2:] if pattern.startswith("+:") else pattern
            overrides.append(("re:" + regex, base.with_params(**_int_params(over, base))))
    for module, over in (qc.get("extra_config") or {}).items():  # AutoRound per-layer settings
        bits = int(over.get("bits", base.bits))
        overrides.append((module, None if bits >= 16 else base.with_params(**_int_params(over, base))))
    ignore = list(qc.get("modules_to_not_convert") or [])
    return QuantScheme(
        method,
        ignore=ignore,
        groups=[(["Linear"], base)],
        overrides=overrides,
        act_order=bool(qc.get("desc_act", False)),
    )


def _int_params(over: dict, base: GPTQ) -> dict:
    bits = int(over.get("bits", base.bits))
    if bits not in (4, 8):
        raise ConfigError(f"{KEY}: per-module bits {bits} are not supported (4, 8, or >= 16 for unquantized)")
    return {"bits": bits, "group": int(over.get("group_size", base.group))}


def _require(section: dict, name: str, key: str, want: Any, default: Any = None) -> None:
    got = section.get(key, default)
    if got != want:
        raise ConfigError(f"{name}.{key}: must be {want!r}, got {got!r}")


def _layer_range(section: dict, name: str) -> tuple[int, int]:
    bounds = section.get("layers")
    if not (
        isinstance(bounds, list)
        and len(bounds) == 2
        and all(isinstance(b, int) for b in bounds)
        and 0 <= bounds[0] <= bounds[1]
    ):
        raise ConfigError(f"{name}.layers: must be [first, last] (inclusive), got {bounds!r}")
    return bounds[0], bounds[1]


def _nf4i8(qc: dict) -> QuantScheme:
    """``dgpp_nf4i8`` (``mixed-codebook-packed`` version 1): on one inclusive layer range, the routed experts in
    the NF4I8 codebook format (``dgpp.quant.codebook``) and the attention projections and shared experts as int8
    group-64 pack-quantized triples (``retained_int8``); everything else dense. Every field the arithmetic
    depends on must say what the code implements."""
    _require(qc, KEY, "format", "mixed-codebook-packed")
    _require(qc, KEY, "format_version", 1)
    if qc.get("kv_cache_scheme") is not None:
        raise ConfigError(f"{KEY}.kv_cache_scheme: a KV cache scheme is not supported")
    retained, routed = qc.get("retained_int8"), qc.get("routed_experts")
    for key, section in (("retained_int8", retained), ("routed_experts", routed)):
        if not isinstance(section, dict):
            raise ConfigError(f"{KEY}.{key}: missing")
    r8, rx = f"{KEY}.retained_int8", f"{KEY}.routed_experts"
    _require(retained, r8, "group_size", 64)
    _require(retained, r8, "scale_dtype", "bfloat16", "bfloat16")
    for key, want, default in (
        ("bits", 4, None),
        ("group_size", 128, None),
        ("indices_dtype", "int32", "int32"),
        ("indices_key", "weight_indices", "weight_indices"),
        ("scale_dtype", "bfloat16", "bfloat16"),
        ("codebook", list(NF4I8_LEVELS), None),
    ):
        _require(routed, rx, key, want, default)
    first, last = _layer_range(retained, r8)
    if _layer_range(routed, rx) != (first, last):
        raise ConfigError(f"{rx}.layers: must equal retained_int8.layers (one packed range)")
    rotation = routed.get("input_transform")
    if not isinstance(rotation, dict):
        raise ConfigError(f"{rx}.input_transform: missing (the rotation the experts were quantized under)")
    rt = f"{rx}.input_transform"
    _require(rotation, rt, "type", "normalized_hadamard")
    _require(rotation, rt, "block_size", ROTATION_BLOCK)
    _require(rotation, rt, "axis", "input_channels", "input_channels")
    if sorted(rotation.get("apply_to") or []) != ["down_proj", "gate_proj", "up_proj"]:
        raise ConfigError(f"{rt}.apply_to: the rotation applies to gate_proj, up_proj and down_proj")
    layers = "(?:" + "|".join(str(i) for i in range(first, last + 1)) + ")"
    attention = r"self_attn\.(?:q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    shared = r"mlp\.shared_experts\.(?:gate_proj|up_proj|down_proj)"
    groups: list[tuple[list[str], QuantFormat]] = [
        ([rf"re:model\.layers\.{layers}\.(?:{attention}|{shared})$"], IntPacked(bits=8, group=64)),
        (
            [rf"re:model\.layers\.{layers}\.mlp\.experts\.\d+\.(?:gate_proj|up_proj|down_proj)$"],
            NF4Codebook(),
        ),
    ]
    return QuantScheme("dgpp_nf4i8", groups=groups)


def _dgpp_mixed(qc: dict) -> QuantScheme:
    """``dgpp_mixed`` (GLM-5.3-Flash NVFP4-FP8): the routed experts of the layers ``routed_experts.layers`` lists
    in compressed-tensors NVFP4 (``weight_packed``, E4M3 ``weight_scale`` per 16 inputs, F32 ``weight_global_scale``;
    e2m1 x scale / global), every other module as the ``fp8`` section (a ``quant_method: fp8`` config, block-scaled
    E4M3 with its own ``modules_to_not_convert``) says: the FP8 release's bytes, the MTP layer's experts included.
    A top-level ``modules_to_not_convert`` adds to the section's. The MTP layer and the DSA attention must be the
    FP8 release's (``source: base``)."""
    routed, where = qc.get("routed_experts"), f"{KEY}.routed_experts"
    if not isinstance(routed, dict):
        raise ConfigError(f"{where}: missing (the NVFP4 experts' format and layers)")
    _require(routed, where, "format", "nvfp4-pack-quantized")
    _require(routed, where, "group_size", 16)
    _require(routed, where, "num_bits", 4, 4)
    layers = routed.get("layers")
    if not (isinstance(layers, list) and layers and all(isinstance(i, int) and i >= 0 for i in layers)):
        raise ConfigError(
            f"{where}.layers: must list the layers whose routed experts are NVFP4, got {layers!r}"
        )
    for section in ("mtp_layer", "dsa_attention"):
        part = qc.get(section)
        if part is not None and (not isinstance(part, dict) or part.get("source", "base") != "base"):
            raise ConfigError(
                f"{KEY}.{section}.source: must be 'base' (the FP8 release's tensors), got {part!r}"
            )
    fp8 = qc.get("fp8")
    if not isinstance(fp8, dict):
        raise ConfigError(f"{KEY}.fp8: missing (the FP8 release's quantization_config)")
    try:
        base = _fp8(fp8)
    except ConfigError as e:
        raise ConfigError(str(e).replace(f"{KEY}.", f"{KEY}.fp8.", 1)) from None
    numbers = "|".join(str(i) for i in sorted(set(layers)))
    experts = rf"re:(.*\.)?layers\.(?:{numbers})\.mlp\.experts\.\d+\.(?:gate|up|down)_proj$"
    return QuantScheme(
        "dgpp_mixed",
        ignore=[*base.ignore, *(qc.get("modules_to_not_convert") or [])],
        groups=base.groups,
        overrides=[(experts, NVFP4CompressedTensors()), *base.overrides],
    )


_PARSERS = {
    "dgpp_mixed": _dgpp_mixed,
    "dgpp_nf4i8": _nf4i8,
    "fp8": _fp8,
    "modelopt": _modelopt,
    "compressed-tensors": _compressed_tensors,
    "gptq": _gptq,
    "auto-round": _gptq,
    "autoround": _gptq,
}
