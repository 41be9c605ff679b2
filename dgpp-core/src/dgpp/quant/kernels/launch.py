"""Host side of the weight-only kernel: per-format arguments, tile sizes, split-K and the fixed-order reduce."""

from __future__ import annotations

import dataclasses

import torch

from dgpp.policy import current
from dgpp.quant.bf12 import BF12
from dgpp.quant.format import QuantFormat, Shape, cdiv
from dgpp.quant.fp4 import FP4Grouped
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels.decode_launch import decode_gemv_applies, quant_multi_linear
from dgpp.quant.kernels.operands import interpreting


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile sizes: BM rows of x, BN output columns, BKP stored elements along K per step, split-K ways."""

    bm: int = 16
    bn: int = 32
    bkp: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def has_kernel(fmt: QuantFormat) -> bool:
    if isinstance(fmt, BF12):
        return current().bf12_triton  # DGPP_BF12_TRITON=1 (interpreter-checked, not yet measured)
    return isinstance(fmt, (FP8Block, FP4Grouped, IntPacked, GPTQ))


def _format_args(fmt: QuantFormat, t: dict[str, torch.Tensor], shape: Shape) -> dict:
    from dgpp.quant.kernels.wo_matmul import FMT_FP4, FMT_FP8, FMT_GPTQ, FMT_INT

    n, k = shape
    dummy = t[next(iter(t))]
    args = dict(
        z=dummy,
        g=dummy,
        gidx=dummy,
        stride_zk=0,
        SBN=1,
        BITS=8,
        SCALE_E8M0=False,
        GLOBAL_OP=0,
        ZERO_OFFSET=0,
        HAS_GIDX=False,
    )
    if isinstance(fmt, FP8Block):
        w = t["weight"].view(torch.uint8)
        s = t[fmt.scale_name]
        bn, bk = fmt.block_for(shape)
        args.update(
            w=w,
            s=s,
            FMT=FMT_FP8,
            PACK=1,
            SBN=bn,
            SBK=bk,
            stride_wn=w.stride(0),
            stride_wk=w.stride(1),
            stride_sn=s.stride(0),
            stride_sk=s.stride(1) if s.dim() > 1 else 0,
        )
    elif isinstance(fmt, FP4Grouped):
        w = t[fmt.data_name].view(torch.uint8)
        s = t[fmt.scale_name].view(torch.uint8)  # E4M3 or E8M0 bytes, decoded in the kernel
        e8m0 = fmt.scale_kind == "e8m0"
        args.update(
            w=w,
            s=s,
            FMT=FMT_FP4,
            PACK=2,
            BITS=4,
            SBK=fmt.group,
            SCALE_E8M0=e8m0,
            stride_wn=w.stride(0),
            stride_wk=w.stride(1),
            stride_sn=s.stride(0),
            stride_sk=s.stride(1),
        )
        if fmt.global_name:
            args.update(g=t[fmt.global_name].to(torch.float32), GLOBAL_OP=1 if fmt.global_op == "mul" else 2)
    elif isinstance(fmt, IntPacked):
        w, s = t["weight_packed"], t["weight_scale"]
        args.update(
            w=w,
            s=s,
            FMT=FMT_INT,
            PACK=32 // fmt.bits,
            BITS=fmt.bits,
            SBK=fmt.group_size(shape),
            ZERO_OFFSET=1 << (fmt.bits - 1),
            stride_wn=w.stride(0),
            stride_wk=w.stride(1),
            stride_sn=s.stride(0),
            stride_sk=s.stride(1),
        )
    elif isinstance(fmt, GPTQ):
        w, s, z = t["qweight"], t["scales"], t["qzeros"].contiguous()
        g_idx = t.get("g_idx")
        args.update(
            w=w,
            s=s,
            z=z,
            FMT=FMT_GPTQ,
            PACK=32 // fmt.bits,
            BITS=fmt.bits,
            SBK=fmt.group_size(shape),
            ZERO_OFFSET=fmt.zero_offset,
            stride_wn=w.stride(1),
            stride_wk=w.stride(0),
            stride_sn=s.stride(1),
            stride_sk=s.stride(0),
            stride_zk=z.stride(0),
        )
        if g_idx is not None:
            args.update(gidx=g_idx.to(torch.int32), HAS_GIDX=True)
    else:
        raise NotImplementedError(f"no Triton kernel for format {fmt.name}")
    args["KP"] = k // args["PACK"]
    return args


GEMV_MAX_ROWS = 8  # up to this many rows run the row-independent GEMV path (decode, MTP verify)


def _pack(fmt: QuantFormat) -> int:
    if isinstance(fmt, FP4Grouped):
        return 2
    if isinstance(fmt, (IntPacked, GPTQ)):
        return 32 // fmt.bits
    return 1


def default_config(
    fmt: QuantFormat, m: int, shape: Shape, device: torch.device, gemm: bool = False
) -> TileConfig:
    """Tiles for a [m, K] x [N, K]^T problem. Decode (m <= GEMV_MAX_ROWS): one row per program, K tiles
    that sit inside one scale block where the format allows (scales load once per tile), and split-K so
    that every SM streams weights. Larger m, or ``gemm`` (prefill chunks, whose rows must not change kernel with
    the chunk length): 64x64 tensor-core tiles."""
    n, k = shape
    pack = _pack(fmt)
    if m <= GEMV_MAX_ROWS and not gemm:
        bm, bn, stages = 1, 16, 4
        bkp = max(1, 128 // pack)
        warps = 2 if isinstance(fmt, FP8Block) else 4  # measured best on H200 (docs/benchmarks.md)
        if isinstance(fmt, FP4Grouped):
            bkp = 128
        elif isinstance(fmt, (IntPacked, GPTQ)):
            bkp = max(1, min(128, fmt.group_size(shape)) // pack)
    else:
        bm, bn, stages, warps = 64, 64, 2, 4
        bkp = max(16, 64 // pack)
    if interpreting() or device.type != "cuda":
        return TileConfig(bm=bm, bn=bn, bkp=bkp, split_k=1, num_warps=warps, num_stages=stages)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = cdiv(n, bn) * (1 if bm == 1 else cdiv(m, bm))  # the GEMV split must not depend on m
    split = max(1, min(cdiv(2 * sms, tiles), cdiv(k // pack, bkp) // 4, 16))
    return TileConfig(bm=bm, bn=bn, bkp=bkp, split_k=split, num_warps=warps, num_stages=stages)


def quant_matmul(
    fmt: QuantFormat,
    tensors: dict[str, torch.Tensor],
    x: torch.Tensor,
    shape: Shape,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``x [.., K] @ W^T`` with W in ``fmt`` (tensors as returned by ``fmt.prepare``), via the Triton kernels:
    on a GPU, 1..16 rows of a format the packed decode GEMV covers go there (unless ``config`` pins the
    generic kernel's tiles); everything else runs ``wo_matmul``."""
    import triton.language as tl

    from dgpp.quant.kernels.wo_matmul import wo_matmul_kernel

    if isinstance(fmt, BF12):
        from dgpp.quant.kernels.bf12_gemv import bf12_matmul

        return bf12_matmul(tensors, x, shape)
    n, k = shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    if config is None and decode_gemv_applies(fmt, [tensors], x2, [shape], on_gpu=x.is_cuda):
        # decode rows (1..16): the packed tensor-core GEMV, whole K per program (batch-invariant)
        return quant_multi_linear(fmt, [tensors], x2, [shape])[0].reshape(*lead, n)
    args = _format_args(fmt, tensors, shape)
    cfg = config or default_config(fmt, m, shape, x.device)
    kp = args.pop("KP")
    kp_per_split = cdiv(cdiv(kp, cfg.split_k), cfg.bkp) * cfg.bkp
    split = cdiv(kp, kp_per_split)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    round_dtype = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(x.dtype, tl.float32)
    dot_low = round_dtype is not tl.float32 and not interpreting()
    # Scales: once per row when a K tile sits inside one scale column (mode 1), once per group and
    # broadcast when groups tile the K tile (mode 2), else gathered per weight (mode 0).
    sbk, pack = args["SBK"], args["PACK"]
    if sbk % (cfg.bkp * pack) == 0 and not args["HAS_GIDX"] and args["FMT"] != 1:
        scale_mode = 1
    elif args["FMT"] in (1, 2) and sbk % pack == 0 and cfg.bkp % (sbk // pack) == 0:
        scale_mode = 2
    else:
        scale_mode = 0
    grid = (cdiv(m, cfg.bm), cdiv(n, cfg.bn), split)
    wo_matmul_kernel[grid](
        x2,
        args.pop("w"),
        args.pop("s"),
        args.pop("z"),
        args.pop("g"),
        args.pop("gidx"),
        partial,
        m,
        n,
        kp,
        x2.stride(0),
        args.pop("stride_wn"),
        args.pop("stride_wk"),
        args.pop("stride_sn"),
        args.pop("stride_sk"),
        args.pop("stride_zk"),
        partial.stride(1),
        partial.stride(0),
        kp_per_split,
        ROUND_DTYPE=round_dtype,
        DOT_LOW=dot_low,
        SCALE_MODE=scale_mode,
        BM=cfg.bm,
        BN=cfg.bn,
        BKP=cfg.bkp,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **args,
    )
    out = partial[0] if split == 1 else partial.sum(0)
    return out.to(x.dtype).reshape(*lead, n)
