"""Encoders: dense matrices -> each format's tensors as a checkpoint would ship them.

Used by test fixtures (tiny quantized checkpoints) and by the explicit, logged load-time conversions
(``engine.dense_weights: fp8``). Quantization here is round-to-nearest; what matters is that the output
is a valid instance of the format, whose decoded values are then the ground truth.
"""

from __future__ import annotations

import torch

from dgpp.quant.bf12 import BF12, encode_bf12
from dgpp.quant.codecs import E2M1_MAGNITUDES, e2m1_pack, expand_blocks, pack_int32
from dgpp.quant.format import QuantFormat, cdiv
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1 = torch.tensor(E2M1_MAGNITUDES)


def _tile_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    gn, gk = cdiv(n, bn), cdiv(k, bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.abs().float()
    return padded.reshape(gn, bn, gk, bk).amax(dim=(1, 3))


def _e8m0_from_float(s: torch.Tensor) -> torch.Tensor:
    """Round scales up to a power of two (so codes never overflow) and store 2^(e) as biased bytes."""
    e = torch.ceil(torch.log2(s.clamp_min(2.0**-126))).clamp(-127, 127)
    return (e + 127).to(torch.uint8)


def encode_fp8_block(w: torch.Tensor, fmt: FP8Block) -> dict[str, torch.Tensor]:
    shape = tuple(w.shape)
    block = fmt.block_for(shape)
    scale = (_tile_amax(w, block) / E4M3_MAX).clamp_min(2.0**-120)
    if fmt.scale_format == "e8m0":
        stored = _e8m0_from_float(scale)
        scale = stored.view(torch.float8_e8m0fnu).float()
        stored = stored.view(torch.float8_e8m0fnu)
    elif fmt.scale_format == "bf16":
        stored = scale.to(torch.bfloat16)
        scale = stored.float()
    else:
        stored = scale
    codes = (
        (w.float() / expand_blocks(scale, shape, block)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    )
    if isinstance(fmt, FP8Channel):
        stored = stored.reshape(shape[0], 1)
    return {"weight": codes, fmt.scale_name: stored}


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (0..15) of each value (already divided by its scale)."""
    mag = x.abs().clamp_max(E2M1_MAX)
    idx = (mag.unsqueeze(-1) - _E2M1.to(x.device)).abs().argmin(-1)
    return torch.where((x < 0) & (idx > 0), idx + 8, idx)


def encode_fp4(w: torch.Tensor, fmt: FP4Grouped) -> dict[str, torch.Tensor]:
    n, k = w.shape
    wf = w.float().reshape(n, k // fmt.group, fmt.group)
    amax = wf.abs().amax(-1)
    out: dict[str, torch.Tensor] = {}
    if fmt.scale_kind == "e8m0":
        stored = _e8m0_from_float(amax / E2M1_MAX)
        scale = stored.view(torch.float8_e8m0fnu).float()
        out[fmt.scale_name] = stored
    else:
        # NVFP4: the per-tensor scale maps the largest group scale onto E4M3's range.
        tensor_scale = (amax.max() / (E2M1_MAX * E4M3_MAX)).clamp_min(2.0**-100)
        stored = (amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        scale = stored.float() * tensor_scale
        if fmt.global_op == "div":
            out[fmt.global_name] = (1.0 / tensor_scale).reshape(1).float()
            scale = stored.float() / out[fmt.global_name]
        else:
            out[fmt.global_name] = tensor_scale.reshape(1).float()
        out[fmt.scale_name] = stored
    codes = e2m1_codes(wf / scale.clamp_min(2.0**-126).unsqueeze(-1)).reshape(n, k)
    out[fmt.data_name] = e2m1_pack(codes)
    return out


def _int_codes(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """F32 group scales [N, K/group], the grouped values and the code offset 2^(b-1)."""
    n, k = w.shape
    half = 1 << (bits - 1)
    wf = w.float().reshape(n, k // group, group)
    scale = (wf.abs().amax(-1) / (half - 1)).clamp_min(2.0**-60)
    return scale, wf, half


def encode_int_packed(w: torch.Tensor, fmt: IntPacked) -> dict[str, torch.Tensor]:
    group = fmt.group_size(tuple(w.shape))
    scale, wf, half = _int_codes(w, fmt.bits, group)
    scale = scale.to(torch.bfloat16)
    codes = (wf / scale.float().unsqueeze(-1)).round().clamp(-half, half - 1) + half
    return {
        "weight_packed": pack_int32(codes.reshape(w.shape).to(torch.int64), fmt.bits, dim=1),
        "weight_scale": scale,
        "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
    }


def encode_gptq(w: torch.Tensor, fmt: GPTQ, g_idx: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Symmetric GPTQ; ``g_idx`` (a group per input column) gives act-order layouts."""
    n, k = w.shape
    group = fmt.group_size((n, k))
    groups = torch.arange(k, device=w.device) // group if g_idx is None else g_idx.long().to(w.device)
    half = 1 << (fmt.bits - 1)
    num_groups = k // group
    amax = torch.zeros(num_groups, n, device=w.device).scatter_reduce_(
        0, groups[:, None].expand(k, n), w.float().abs().t(), "amax"
    )
    scales = (amax / (half - 1)).clamp_min(2.0**-14).to(torch.float16)
    codes = (w.float().t() / scales.float()[groups]).round().clamp(-half, half - 1) + half  # [K, N]
    zeros = torch.full((num_groups, n), half - fmt.zero_offset, dtype=torch.int64, device=w.device)
    out = {
        "qweight": pack_int32(codes.to(torch.int64), fmt.bits, dim=0),
        "qzeros": pack_int32(zeros, fmt.bits, dim=1),
        "scales": scales,
    }
    out["g_idx"] = groups.to(torch.int32)
    return out


def encode(fmt: QuantFormat, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Encode dense ``w`` [N, K] into ``fmt``'s tensors."""
    if isinstance(fmt, FP8Block):
        return encode_fp8_block(w, fmt)
    if isinstance(fmt, FP4Grouped):
        return encode_fp4(w, fmt)
    if isinstance(fmt, IntPacked):
        return encode_int_packed(w, fmt)
    if isinstance(fmt, GPTQ):
        return encode_gptq(w, fmt)
    if isinstance(fmt, BF12):
        packed = encode_bf12(w.to(torch.bfloat16))
        if packed is None:
            raise ValueError("matrix has too many escape rows for bf12")
        return packed
    raise NotImplementedError(f"no encoder for format {fmt.name}")
