"""Matrix products whose every output row is the same whatever other rows share the call.

On the CPU, ``F.linear`` picks a different GEMM kernel for 1-3, 5-7 and 9-11 rows (and for a single
output feature) than for larger shapes, so a token's logits could change in the last bit with the
number of tokens in the step (or routed to an expert) — enough to flip a greedy near-tie between a
batched and a solo run. So every CPU row goes through one fixed row-wise kernel: the one-row product
(a GEMV, ``F.linear`` of a single row), whatever else is in the step. A decode step then costs what a
GEMV costs (it is bound by reading the weight once) instead of a GEMM padded to 16 rows, which on a
2-core CPU measured ~75x slower for one row (fp32, 3072x576). Several rows run as one batched product of
one-row products (``torch.bmm`` over rows against the same weight), whose rows measured bit-identical to
the single-row call for every row count up to ``ROW_BATCH`` (and to ``torch.mv``); longer inputs go in
pieces of ``ROW_BATCH`` rows. A weight larger than ``TILE_BYTES`` is multiplied a slice of output features at
a time, every row against one slice before the next (``tile_features``), so the rows of a verify step or a
prefill chunk read each slice from the core's cache instead of the whole weight from memory once per row: the
slices' one-row products give the whole weight's bits (checked once per shape). 4 rows of SmolLM2's
49,152 x 576 fp32 head measured 39.4 -> 19.8 ms of CPU time, its 3,072 x 576 gate/up 1.27 -> 0.79 ms and its
576 x 1,536 down projection 0.57 -> 0.38 ms (one row: 9.4, 0.33 and 0.15 ms; one thread of a shared 2-core VM).

bf16 / fp16 weights take the CPU's own narrow product (oneDNN, fp32 accumulation) where it keeps rows
independent for the weight's shape (``native_row_limit``): it reads half the bytes of an fp32 GEMV. Its
several-row calls measured bit-identical to the row alone for inputs of up to ``MAX_BATCHED_IN`` features on
a CPU with bf16 dot products (AVX512-BF16); a longer input (a ``down_proj``'s 1536) goes one row a call,
each call the row alone by definition. Parameters (and fused weights) multiply against a copy in oneDNN's
blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, kept next to the weight and rebuilt if it
changes in place): the same bits as the plain call, read at about twice the rate (one thread, one row, 576
inputs: 3072 outputs 65 against 153 us, the 49,152-row head 1.5 against 3.6 ms), for a second copy of the
weight in memory. Each shape is checked once per process against the row-alone product before it is used.
Where the CPU's narrow kernel fails the check they are multiplied in fp32: the fp32 copy is made once per
weight (kept next to it, rebuilt if the weight changes in place), the inputs are widened exactly, and the
product is rounded once to the activation dtype: what a bf16 GEMM with fp32 accumulation computes, at fp32
GEMV speed (CPUs without bf16 units run the bf16 GEMV ~10x slower than the fp32 one). CUDA has its own
kernels and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROW_BATCH = 256
# several rows: weight slices of about this many bytes, read by every row while in the core's cache (2 MiB L2);
# a weight of fewer than two slices is read whole (the slices' extra calls cost more than they save)
TILE_BYTES = 1 << 20
TILE_MULTIPLE = 16  # features per tile: whole vector blocks of the GEMV's outputs
_TILE_PROBE_ROWS = 3
_tile_verdicts: dict[tuple[object, ...], bool] = {}
MIN_OUT_FEATURES = 16  # a one- or few-output product takes a dot-product kernel of its own: pad the weight
_NARROW = (torch.bfloat16, torch.float16)


# longer inputs: oneDNN's bf16 sum is blocked by the row count (a random check can miss it)
MAX_BATCHED_IN = 1024
_PROBE_ROWS = (2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 64, 65, 128, ROW_BATCH)
_PROBE_CHECKED = 65
_native_verdicts: dict[tuple[torch.dtype, int, int, int], tuple[int, bool]] = {}


def rows_alone(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``product`` of each of the first ``_PROBE_CHECKED`` rows of ``x`` alone, one call a row."""
    return torch.cat([product(x[i : i + 1]) for i in range(_PROBE_CHECKED)])


def rows_match(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, alone: torch.Tensor) -> bool:
    """Whether calls of ``product`` on the first n rows of ``x`` give each row ``alone``'s bits (``rows_alone``),
    for every n of ``_PROBE_ROWS``: the row counts where CPU kernels change their tiles (``x`` holds
    ``ROW_BATCH`` rows)."""
    return all(
        torch.equal(product(x[:rows])[:_PROBE_CHECKED], alone[: min(rows, _PROBE_CHECKED)])
        for rows in _PROBE_ROWS
    )


def _can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered into oneDNN's blocked layout for a one-row product, or None where this torch / CPU
    cannot (fp16 needs AVX512-FP16 or AVX-NE-CONVERT)."""
    if not _can_pack(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    except RuntimeError:
        return None


def _packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # the overload itself: calling the packet resolves it on every call (12 us of a 30 us decode product)
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, None, "none", [], "")


def _native_verdict(dtype: torch.dtype, out_features: int, in_features: int) -> tuple[int, bool]:
    """``(rows per call, packed)`` of the CPU's own ``dtype`` product of a ``[out, in]`` weight: checked once per
    shape and thread count on random data against ``F.linear`` of each row alone, at the row counts where CPU
    GEMM kernels change (module docstring). ``packed``: the packed-weight call gives each row alone those bits.
    ``ROW_BATCH`` rows when calls of 2..ROW_BATCH rows agree too (for every kernel in use) and the input is at
    most ``MAX_BATCHED_IN`` wide; else one row when the packed call is exact (oneDNN's bf16 kernel blocks a
    longer input's sum by the row count: 1536 inputs on an AVX512-BF16 CPU differ in a few rows in a hundred,
    in the last bit); 0 (not used) otherwise."""
    if dtype not in _NARROW or out_features < MIN_OUT_FEATURES:
        return 0, False
    key = (dtype, out_features, in_features, torch.get_num_threads())
    verdict = _native_verdicts.get(key)
    if verdict is None:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
        x = torch.randn(ROW_BATCH, in_features, generator=gen).to(dtype)
        with torch.inference_mode():
            alone = rows_alone(lambda rows: F.linear(rows, weight), x)
            packed = _pack(weight)
            packed_ok = packed is not None and torch.equal(
                rows_alone(lambda rows: _packed_product(rows, packed), x), alone
            )
            products = [lambda rows: F.linear(rows, weight)]
            if packed_ok:
                products.append(lambda rows: _packed_product(rows, packed))
            batched_ok = in_features <= MAX_BATCHED_IN and all(
                rows_match(product, x, alone) for product in products
            )
        verdict = (ROW_BATCH if batched_ok else 1 if packed_ok else 0), packed_ok
        _native_verdicts[key] = verdict
    return verdict


def native_row_limit(dtype: torch.dtype, out_features: int, in_features: int) -> int:
    """How many rows one call of the CPU's own ``dtype`` product may hold with every row given the bits of the
    row alone (``_native_verdict``): ``ROW_BATCH``, 1, or 0 where the native product is not used."""
    return _native_verdict(dtype, out_features, in_features)[0]


def native_rows_exact(dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """Whether narrow weights of this shape take the CPU's own product (``native_row_limit``)."""
    return native_row_limit(dtype, out_features, in_features) > 0


def _packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout, cached on it (keyed by its storage and in-place version counter)."""
    key = (weight.data_ptr(), _version(weight))
    cached = getattr(weight, "_dgpp_packed", None)
    if cached is None or cached[0] != key:
        with torch.inference_mode():
            cached = (key, _pack(weight))
        weight._dgpp_packed = cached
    return cached[1]


def native_row_products(x: torch.Tensor, weight: torch.Tensor, *, keep_packed: bool = False) -> torch.Tensor:
    """``x @ weight.T`` in the weights' own narrow dtype, in calls of at most ``native_row_limit`` rows.
    ``keep_packed``: ``weight`` lives on (a parameter, a fused weight): multiply against a copy of it in
    oneDNN's blocked layout, kept next to it. Its rows are the plain call's bits (checked with the limit) and
    its one-row product reads the weight at about twice the rate (576 x 3072 bf16, one thread: 65 against 153 us)."""
    limit, packs = _native_verdict(weight.dtype, *weight.shape)
    packed = _packed_weight(weight) if keep_packed and packs else None
    product = F.linear if packed is None else lambda rows, _: _packed_product(rows, packed)
    if x.shape[0] <= limit:
        return product(x, weight)
    return torch.cat([product(chunk, weight) for chunk in x.split(limit)])


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter; -1 for an inference tensor (which keeps none)."""
    return -1 if t.is_inference() else t._version


def _fp32_weight(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of a narrow parameter, cached on it (keyed by its in-place version counter)."""
    cached = getattr(weight, "_dgpp_fp32", None)
    if cached is None or cached[0] != _version(weight):
        cached = (_version(weight), weight.detach().float())
        weight._dgpp_fp32 = cached
    return cached[1]


def _one_row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Every row of ``x`` times ``weight.T`` as one-row products, in one batched call."""
    return torch.bmm(x.unsqueeze(1), weight.t().expand(x.shape[0], -1, -1)).squeeze(1)


def _tiled_one_row_products(x: torch.Tensor, weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``_one_row_products`` a tile of ``tile`` output features at a time: each tile stays in the core's cache
    while every row reads it."""
    return torch.cat([_one_row_products(x, part) for part in weight.split(tile)], dim=1)


def tile_features(weight: torch.Tensor) -> int:
    """Output features per tile of a several-row product of ``weight`` (``_tile_verdict``); 0: untiled."""
    out_features, in_features = weight.shape
    tile = TILE_BYTES // (in_features * weight.element_size()) // TILE_MULTIPLE * TILE_MULTIPLE
    if tile < TILE_MULTIPLE or 2 * tile > out_features:
        return 0
    return tile if _tile_verdict(weight, tile) else 0


def _tile_verdict(weight: torch.Tensor, tile: int) -> bool:
    """Whether one-row products against ``tile``-feature slices of ``weight`` give the bits of the one-row product
    against the whole weight (a GEMV's sum over the inputs does not depend on how many outputs it makes, for
    these shapes): checked once per shape and thread count on random rows."""
    key = (weight.dtype, *weight.shape, tile, torch.get_num_threads())
    verdict = _tile_verdicts.get(key)
    if verdict is None:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(_TILE_PROBE_ROWS, weight.shape[1], generator=gen).to(weight.dtype)
        with torch.inference_mode():
            alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(_TILE_PROBE_ROWS)])
            verdict = torch.equal(_tiled_one_row_products(x, weight, tile), alone)
        _tile_verdicts[key] = verdict
    return verdict


def row_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [rows, in] @ weight[out, in].T``, each row through the one-row product (see module docstring)."""
    rows, out_features = x.shape[0], weight.shape[0]
    if out_features < MIN_OUT_FEATURES:
        return row_products(x, F.pad(weight, (0, 0, 0, MIN_OUT_FEATURES - out_features)))[:, :out_features]
    if rows == 1:
        return F.linear(x, weight)
    if rows == 0:
        return x.new_empty(0, out_features)
    tile = tile_features(weight)
    parts = [
        _tiled_one_row_products(chunk, weight, tile) if tile else _one_row_products(chunk, weight)
        for chunk in x.split(ROW_BATCH)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows independent of the batch (see module docstring)."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    rows, out_features = x.numel() // x.shape[-1], weight.shape[0]
    flat = x.reshape(rows, x.shape[-1])
    if weight.dtype in _NARROW and isinstance(weight, torch.nn.Parameter):
        if x.dtype == weight.dtype and native_rows_exact(weight.dtype, *weight.shape):
            out = native_row_products(flat, weight, keep_packed=True)
        else:
            out = row_products(flat.float(), _fp32_weight(weight)).to(x.dtype)
    else:
        out = row_products(flat, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


def _fused_weight(weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``cat(weights)`` in the CPU compute dtype, cached on the first weight. fp32 weights, and narrow ones
    whose fused shape takes the native product, become views into it (no second copy: an in-place change
    of one shows in the whole); other narrow weights get one fp32 copy of them all, in place of one per
    weight, rebuilt when any of them changes in place."""
    key = tuple((w.data_ptr(), _version(w)) for w in weights)
    cached = getattr(weights[0], "_dgpp_fused", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    dtype, out_features = weights[0].dtype, sum(w.shape[0] for w in weights)
    # built outside inference mode: parameters re-pointed into an inference tensor would become one (and
    # inference-tensor parameters, made under inference mode, keep their own storage: a copy is fused)
    with torch.inference_mode(False):
        if dtype in _NARROW and not native_rows_exact(dtype, out_features, weights[0].shape[1]):
            fused = torch.cat([w.detach().float() for w in weights])
        else:
            fused = torch.cat([w.detach() for w in weights])
        if fused.dtype == dtype and not any(w.is_inference() for w in weights):
            offset = 0
            for w in weights:  # the parameters now live in the fused tensor
                w.data = fused[offset : offset + w.shape[0]]
                offset += w.shape[0]
            key = tuple((w.data_ptr(), _version(w)) for w in weights)
    weights[0]._dgpp_fused = (key, fused)
    return fused


def batch_invariant_fused_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``cat([F.linear(x, w) for w in weights], -1)`` as one row-wise product against the concatenated
    weights (CPU, parameters without bias, one dtype): one GEMV a decode row instead of one per weight.
    Every row of every step goes through the fused weight, so rows stay independent of their batch mates."""
    rows, out_features = x.numel() // x.shape[-1], sum(w.shape[0] for w in weights)
    flat = x.reshape(rows, x.shape[-1])
    fused = _fused_weight(weights)
    if fused.dtype != x.dtype:
        out = row_products(flat.float(), fused).to(x.dtype)
    elif fused.dtype in _NARROW:
        out = native_row_products(flat, fused, keep_packed=True)
    else:
        out = row_products(flat, fused)
    return out.reshape(*x.shape[:-1], out_features)


ROW_MULTIPLE = 64
SERIAL_ELEMENTS = 16384  # below torch's elementwise grain (32768): one thread, no split of the range


def batch_invariant_rows(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, elementwise: bool = False
) -> torch.Tensor:
    """``fn(x)`` for a row-wise / elementwise ``fn`` of ``x [rows, n]``, each row's result independent of
    ``rows``. CPU elementwise kernels (``torch.sigmoid``, ``F.silu``) treat a tensor's vector tail apart from
    its body, so a row's last bit could depend on how many rows came with it; padding the rows to a multiple
    of ``ROW_MULTIPLE`` keeps every element of a row on the same side (measured for widths 8..512, 1..70 rows).

    An ``elementwise`` ``fn`` of a contiguous input of fewer than ``SERIAL_ELEMENTS`` elements, a multiple of ``ROW_MULTIPLE`` in all, runs
    on one thread and wholly in the vector body already (its body steps are at most 64 elements), so it skips
    the padding: a decode row of a SwiGLU (1 x 1536) then costs its own silu, not 64 rows' (0.11 ms a call). A
    strided input of that size (the gate half of a fused gate/up product of a few verify rows) is copied
    contiguous first: a copy of a few rows costs less than 64 padded rows' silu."""
    if x.device.type != "cpu" or x.dim() != 2:
        return fn(x)
    rows = x.shape[0]
    if elementwise and x.numel() % ROW_MULTIPLE == 0 and x.numel() <= SERIAL_ELEMENTS:
        return fn(x.contiguous())
    pad = -rows % ROW_MULTIPLE
    return fn(F.pad(x, (0, 0, 0, pad)))[:rows] if pad else fn(x)


def rows_elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise ``fn`` (``torch.sigmoid``, ``F.softplus``, ``torch.exp``) of ``x [rows, ...]`` whose every row
    has the bits it has alone: ``batch_invariant_rows`` over the rows flattened to 2-D (on a GPU, ``fn(x)``)."""
    if x.device.type != "cpu":
        return fn(x)
    return batch_invariant_rows(fn, x.reshape(x.shape[0], -1), elementwise=True).view(x.shape)
