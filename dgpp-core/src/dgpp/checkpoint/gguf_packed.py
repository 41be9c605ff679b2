"""``engine.gguf_weights: int4pack``: a converted GGUF checkpoint's Q4_1, Q4_0 and Q8_0 matrices multiplied packed on
the CPU (``dgpp.nn.int4pack_cpu``) instead of decoded. Off by default, because it is lossy.

A converted checkpoint keeps the GGUF's raw blocks beside its decoded weights (``gguf_convert.BLOCKS_FILE``). After
loading, every dense ``Linear`` (and the LM head, tied or not) whose weight the file stores as Q4_1, Q4_0 or Q8_0
gets the packed weight, and its decoded weight is dropped; float matrices (F32, F16, BF16) stay as they are. How each type maps onto torch's int4 product, which computes
``w = fma(code - 8, s, z)`` per weight from a scale and zero per 32 inputs:

- Q4_1 (``w = d * q + m``, ``q`` 0..15, fp16 ``d`` and ``m``): code ``q``, ``s = d``, ``z = m + 8 d``. With fp32
  scales that is exactly the GGUF's weight wherever ``m + 8 d`` is exact in fp32 (it is for every block of the
  demo). The product runs on bf16 scales and zeros, though (the fast kernel's only form): ``s = bf16(d)``,
  ``z = bf16(m + 8 d)``, moving a weight by at most ``8 |d - s| + |z - (m + 8 d)|``.
- Q4_0 (``w = d * (q - 8)``): code ``q``, ``s = d``, ``z = 0`` (``bf16(d)`` in the product).
- Q8_0 (``w = d * q``, ``q`` int8): two int4 planes side by side along K, multiplied by the input repeated twice
  in one call: the high nibble ``h = q >> 4`` (code ``h + 8``, ``s = 16 d``, ``z = 0``) and the low nibble
  ``l = q & 15`` (code ``l``, ``s = d``, ``z = 8 d``); their sum is ``d * q`` for any ``d`` (bf16 scales: ``bf16(d) * q``).
  torch's int8 weight-only product (``_weight_int8pack_mm``) takes one scale per output feature, which a per-32
  scale does not fit.

Inputs, products and outputs are bf16 whatever the compute dtype (an fp32 model casts around each product).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dgpp.checkpoint.gguf_blocks import BLOCK, BLOCK_BYTES, q4_0_fields, q4_1_fields, q8_0_fields
from dgpp.checkpoint.gguf_convert import BLOCKS_FILE
from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.log import get_logger
from dgpp.nn.embedding import LMHead
from dgpp.nn.int4pack_cpu import (
    GROUP,
    OUT_MULTIPLE,
    Int4PackedWeight,
    Int4PackLinearMethod,
    int4pack_available,
)
from dgpp.nn.linear import Linear, UnquantizedLinearMethod

log = get_logger("dgpp.gguf")
KEY = "engine.gguf_weights"


def _shape(rows: torch.Tensor, type_name: str) -> tuple[int, int]:
    """``[N, K]`` of the weight whose raw blocks are ``rows [N, bytes]``."""
    return rows.shape[0], rows.shape[1] // BLOCK_BYTES[type_name] * BLOCK


def q4_1_operands(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [N, K], scale_zeros [K / 32, N, 2])`` of Q4_1 blocks ``rows [N, K / 32 * 20]`` for the int4 product,
    scales and zeros in ``dtype`` (fp32: the GGUF's weights exactly, where ``m + 8 d`` is exact in fp32)."""
    n, k = _shape(rows, "Q4_1")
    q, d, m = q4_1_fields(rows.reshape(-1, BLOCK_BYTES["Q4_1"]))
    scale, zero = d.reshape(n, k // BLOCK), (m + 8 * d).reshape(n, k // BLOCK)
    return q.reshape(n, k), torch.stack((scale.t(), zero.t()), dim=-1).to(dtype).contiguous()


def q4_0_operands(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [N, K], scale_zeros [K / 32, N, 2])`` of Q4_0 blocks ``rows [N, K / 32 * 18]``: code ``q``, ``s = d``,
    ``z = 0`` (exact for any ``d`` with fp32 scales)."""
    n, k = _shape(rows, "Q4_0")
    q, d = q4_0_fields(rows.reshape(-1, BLOCK_BYTES["Q4_0"]))
    scale = d.reshape(n, k // BLOCK).t()
    return q.reshape(n, k), torch.stack((scale, torch.zeros_like(scale)), dim=-1).to(dtype).contiguous()


def q8_0_operands(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [N, 2K], scale_zeros [2K / 32, N, 2])``: Q8_0 blocks ``rows [N, K / 32 * 34]`` as a high-nibble plane
    then a low-nibble plane (module docstring), for an input repeated twice."""
    n, k = _shape(rows, "Q8_0")
    q, d = q8_0_fields(rows.reshape(-1, BLOCK_BYTES["Q8_0"]))
    q, d = q.reshape(n, k).to(torch.int32), d.reshape(n, k // BLOCK).t()
    codes = torch.cat(((q >> 4) + 8, q & 15), dim=1)
    high = torch.stack((16 * d, torch.zeros_like(d)), dim=-1)
    low = torch.stack((d, 8 * d), dim=-1)
    return codes, torch.cat((high, low)).to(dtype).contiguous()


OPERANDS: dict[str, tuple[Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]], int]] = {
    "Q4_0": (q4_0_operands, 1),
    "Q4_1": (q4_1_operands, 1),
    "Q8_0": (q8_0_operands, 2),
}


def packed_weight(rows: torch.Tensor, type_name: str) -> Int4PackedWeight:
    """The ``Int4PackedWeight`` of one GGUF block-quant matrix (raw blocks ``rows``)."""
    operands, planes = OPERANDS[type_name]
    return Int4PackedWeight.from_codes(*operands(rows, torch.bfloat16), planes)


def _targets(model: nn.Module, rename: Callable[[str], str]) -> list[tuple[str, nn.Module, str]]:
    """``(checkpoint weight name, module, kind)`` for every dense ``Linear`` and LM head of ``model``."""
    param_names = {id(p): name for name, p in model.named_parameters()}
    found = []
    for name, module in model.named_modules():
        if isinstance(module, Linear) and isinstance(module.quant_method, UnquantizedLinearMethod):
            found.append((rename(f"{name}.weight"), module, "linear"))
        elif isinstance(module, LMHead) and id(module.weight) in param_names:
            found.append((rename(param_names[id(module.weight)]), module, "head"))
    return found


def packed_bytes(type_name: str, out_features: int, in_features: int) -> int:
    """Resident bytes of the ``Int4PackedWeight`` of an ``[out_features, in_features]`` matrix stored as
    ``type_name``: the int4 codes (two a byte) and a bf16 scale and zero per ``GROUP`` inputs, for each plane,
    over the outputs padded to ``OUT_MULTIPLE``."""
    planes = OPERANDS[type_name][1]
    rows = out_features + -out_features % OUT_MULTIPLE
    k = planes * in_features
    return rows * k // 2 + (k // GROUP) * rows * 2 * 2


def planned_packing(
    model: nn.Module,
    checkpoint_dir: Path,
    engine: EngineConfig,
    rename: Callable[[str], str] = lambda name: name,
) -> tuple[dict[int, int], int]:
    """What ``pack_gguf_weights`` would do to ``model`` (built on ``meta``), from the blocks file's metadata
    alone (no tensor read): ``({id(linear weight): packed bytes}, bytes)`` where each dense Linear's decoded weight
    is replaced by its packed form (dropped), and the LM head's packed form is added beside its weight (kept:
    the head, tied or not, holds its decoded weight too). Empty unless ``engine.gguf_weights`` is ``int4pack``
    and the checkpoint was converted from GGUF (the load refuses the key otherwise)."""
    if engine.gguf_weights != "int4pack":
        return {}, 0
    path = Path(checkpoint_dir) / BLOCKS_FILE
    if not path.is_file():
        return {}, 0
    with safe_open(str(path), framework="pt") as f:
        types = json.loads((f.metadata() or {}).get("ggml_types", "{}"))
    linears: dict[int, int] = {}
    head = 0
    for name, module, kind in _targets(model, rename):
        type_name = types.get(name)
        if type_name not in OPERANDS:
            continue
        size = packed_bytes(type_name, *module.weight.shape)
        if kind == "linear":
            linears[id(module.weight)] = size
        else:
            head += size
    return linears, head


def pack_gguf_weights(
    model: nn.Module,
    checkpoint_dir: Path,
    engine: EngineConfig,
    rename: Callable[[str], str] = lambda name: name,
) -> int:
    """Apply ``engine.gguf_weights`` to a loaded model (module docstring); returns how many matrices were packed."""
    if engine.gguf_weights != "int4pack":
        return 0
    path = Path(checkpoint_dir) / BLOCKS_FILE
    if not path.is_file():
        raise ConfigError(
            f"{KEY}: 'int4pack' needs a checkpoint converted from a GGUF file ({checkpoint_dir} has no "
            f"{BLOCKS_FILE}; a GGUF converted by an older dgpp is converted again when its cache entry "
            "is removed)"
        )
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ConfigError(f"{KEY}: 'int4pack' is a CPU product; this engine's weights are not on the CPU")
    if not int4pack_available():
        raise ConfigError(
            f"{KEY}: 'int4pack' needs torch's CPU int4 product (aten._weight_int4pack_mm_for_cpu), "
            f"which torch {torch.__version__} lacks"
        )
    packed = 0
    with safe_open(str(path), framework="pt") as f:
        types = json.loads((f.metadata() or {}).get("ggml_types", "{}"))
        for name, module, kind in _targets(model, rename):
            if types.get(name) not in OPERANDS:
                continue
            if getattr(module, "world", None) is not None and module.world.size > 1:
                raise ConfigError(
                    f"{KEY}: 'int4pack' serves one rank; {name} is split over {module.world.size}"
                )
            weight = packed_weight(f.get_tensor(name), types[name])
            expected = tuple(module.weight.shape)
            if (weight.out_features, weight.in_features) != expected:
                raise ConfigError(
                    f"{path}: {name} holds a [{weight.out_features}, {weight.in_features}] matrix; "
                    f"the model's is {list(expected)}"
                )
            if kind == "linear":
                Int4PackLinearMethod.adopt(module, weight)
            else:
                module.packed = weight
            packed += 1
    log.warning(
        f"{KEY}=int4pack: GGUF Q4_1/Q4_0/Q8_0 matrices multiplied packed in bf16 (bf16 block scales; lossy)",
        packed=packed,
    )
    return packed
