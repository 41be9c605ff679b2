"""The one-launch quantized cache write (``dgpp.kernels.quantized_write``, Triton interpreter) against the torch
encoder (``quantize_latent`` then the scatter): the same bytes in the codes / packed rows, the fp32 row scales and
the ``k_rot`` rows, for fp32 and bf16 rows of every magnitude, zero rows and blocks, saturating values, exact
rounding ties and skipped slots; the stored rows read back within the format's error."""

from __future__ import annotations

import pytest
import torch

from dgpp.kernels.latent_formats import dequantize_latent, e2m1_values
from dgpp.kernels.quantized_write import write_quantized_ref, write_quantized_triton
from dgpp.step.cache_spec import KV_FP8, fp4_row_bytes

BLOCKS, BS, ROPE = 30, 4, 8
GARBAGE = 0xA5  # what a slot holds before the write: a skipped row must leave it


def _pools(fmt: str, width: int, rope_dtype: torch.dtype):
    stored_width = width if fmt == "fp8" else fp4_row_bytes(width)
    cache = torch.full((BLOCKS, BS, 1, stored_width), GARBAGE, dtype=torch.uint8)
    if fmt == "fp8":
        cache = cache.view(KV_FP8)
    scale = torch.full((BLOCKS, BS, 1, 1), -1.0)
    rope = torch.full((BLOCKS, BS, 1, ROPE), -2.0, dtype=rope_dtype)
    return cache, scale, rope


def _write_both(fmt: str, rows: torch.Tensor, slots: torch.Tensor, k_rot: torch.Tensor | None = None):
    """(kernel pools, torch pools) after writing ``rows`` (and ``k_rot``) at ``slots``, the codes as bytes."""
    out = []
    for write in (write_quantized_triton, write_quantized_ref):
        cache, scale, rope = _pools(fmt, rows.shape[-1], rows.dtype)
        write(cache, scale, rows, slots, None if k_rot is None else rope, k_rot)
        out.append((cache.view(torch.uint8), scale, rope))
    return out


def _assert_same_bytes(ours, ref) -> None:
    for got, want in zip(ours, ref, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _awkward_rows(width: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows whose magnitudes span 1e-30 .. 5e37, with a zero row, a zero block, a row of one dominating
    value (the rest round to e4m3 subnormals or zero), rows of blocks of very different sizes, negative zeros, a row
    of fp32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-30, 30, 24).tolist() + [5e37, 1.0, 1.0, 1.0]
    rows = torch.randn(len(magnitudes), 1, width, generator=g) * torch.tensor(magnitudes)[:, None, None]
    rows[1] = 0.0
    rows[2, 0, 16:32] = 0.0
    rows[3, 0, 5] = 1e4
    rows[4] *= torch.logspace(-12, 0, width)  # block maxima spread over 12 decades
    rows[5, 0, ::3] = -0.0
    # saturating at both formats' tops
    rows[6, 0, :] = torch.tensor([448.0, -448.0, 6.0, -6.0] * (width // 4))
    if (
        dtype == torch.float32
    ):  # Triton's interpreter widens bf16 subnormals wrongly (a GPU shifts them exactly)
        rows[7] = torch.randn(1, width, generator=g) * 1e-39  # fp32 subnormals: the fp4 row scale underflows
        rows[7, 0, 16:32] = 0.0  # a zero block where 448 / amax overflows (its scale code is NaN, as torch's)
    return rows.to(dtype)


# the subnormal row overflows 448 / amax on purpose, as torch does; numpy warns inside the interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("width", [64, 48, 512])
def test_kernel_stores_the_torch_encoders_bytes(fmt, width, dtype):
    """Codes / packed rows (block scale bytes and zero padding included), row scales and ``k_rot``: the same bytes
    as the torch encoder's write; bf16 rows are read as they are and widened to fp32 in the kernel."""
    rows = _awkward_rows(width, seed=width, dtype=dtype)
    k_rot = torch.randn(rows.shape[0], 1, ROPE, generator=torch.Generator().manual_seed(1)).to(dtype)
    slots = torch.randperm(BLOCKS * BS, generator=torch.Generator().manual_seed(2))[: rows.shape[0]]
    slots[[0, 9]] = -1  # padding rows / rows not kept
    ours, ref = _write_both(fmt, rows, slots, k_rot)
    _assert_same_bytes(ours, ref)
    written = slots[slots >= 0]
    unwritten = torch.ones(BLOCKS * BS, dtype=torch.bool)
    unwritten[written] = False
    cache, scale, rope = ours
    assert bool((cache.flatten(0, 1)[unwritten] == GARBAGE).all())  # the skipped rows left their slots alone
    assert bool((scale.flatten(0, 1)[unwritten] == -1.0).all()) and bool(
        (rope.flatten(0, 1)[unwritten] == -2).all()
    )
    assert torch.equal(rope.flatten(0, 1)[written], k_rot[slots >= 0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the subnormal row, as above
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_a_row_stores_the_same_bytes_alone_or_in_a_batch(fmt):
    rows = _awkward_rows(64, seed=3, dtype=torch.float32)
    slots = torch.arange(rows.shape[0]) * 3
    batched = _write_both(fmt, rows, slots)[0]
    cache, scale, rope = _pools(fmt, 64, torch.float32)
    for r in range(rows.shape[0]):
        write_quantized_triton(cache, scale, rows[r : r + 1], slots[r : r + 1])
    _assert_same_bytes((cache, scale), batched[:2])


def test_e4m3_codes_round_to_nearest_even_at_every_tie_and_in_the_subnormals():
    """A row whose amax is 448 has scale 1, so its codes are e4m3(x) directly: every midpoint between neighbouring
    e4m3 values (ties go to the even code), the floats either side of it and the subnormal range."""
    values = (
        torch.arange(0, 0x7F, dtype=torch.uint8).view(KV_FP8).float()
    )  # every finite non-negative e4m3 value
    mids = (values[:-1] + values[1:]) / 2  # exact in fp32
    probes = torch.cat([values, mids, mids.nextafter(torch.zeros(1)), mids.nextafter(torch.full((1,), 1e9))])
    probes = torch.cat([probes, -probes, torch.tensor([448.0])])
    width = 16 * -(-probes.numel() // 16)
    row = torch.zeros(1, 1, width)
    row[0, 0, : probes.numel()] = probes
    ours, ref = _write_both("fp8", row, torch.tensor([5]))
    _assert_same_bytes(ours, ref)
    codes = ours[0].flatten(0, 1)[5, 0, : probes.numel()].view(KV_FP8).float()
    n, m = values.numel(), mids.numel()
    assert torch.equal(codes[:n], values)  # exact values keep their code
    lower_is_even = torch.arange(m) % 2 == 0
    assert torch.equal(codes[n : n + m], torch.where(lower_is_even, values[:-1], values[1:]))
    assert torch.equal(codes[n + m : n + 2 * m], values[:-1]) and torch.equal(
        codes[n + 2 * m : n + 3 * m], values[1:]
    )


def test_e2m1_codes_break_ties_to_the_even_code_as_the_encoder():
    """A block whose largest value is 6 in a row of amax 2688 has scale 1: its codes are e2m1(x) directly."""
    ties = torch.tensor(
        [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0]
    )
    row = torch.zeros(1, 1, 32)
    row[0, 0, :16] = 2688.0
    row[0, 0, 16:] = ties
    ours, ref = _write_both("fp4", row, torch.tensor([0]))
    _assert_same_bytes(ours, ref)
    packed = ours[0].flatten(0, 1)[0, 0]
    codes = torch.stack((packed[8:16] & 15, packed[8:16] >> 4), dim=-1).flatten()
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0, -6.0]
    assert e2m1_values(codes).tolist() == expected


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_stored_rows_read_back_within_the_formats_error_at_any_magnitude(fmt):
    """Read back through ``dequantize_latent``, every row is within its format's error of the input: fails if the
    kernel dropped the row scale (rows at 1e-20 or 1e20 would round to zero or saturate) or, under fp4, the block
    scale (a block 1e4 times smaller than its row's largest would read back as zeros)."""
    g = torch.Generator().manual_seed(7)
    rows = (
        torch.randn(6, 1, 64, generator=g) * torch.tensor([1e-20, 1e-3, 1.0, 1e3, 1e20, 1.0])[:, None, None]
    )
    rows[5, 0, 16:] *= 1e-4
    slots = torch.arange(6) + 4
    cache, scale, _ = _pools(fmt, 64, torch.float32)
    write_quantized_triton(cache, scale, rows, slots)
    back = dequantize_latent(cache.flatten(0, 1)[slots], scale.flatten(0, 1)[slots], 64, torch.float32)
    blocks = rows.unflatten(-1, (4, 16))
    bound = 2**-4 if fmt == "fp8" else 0.25  # relative to the element (fp8) or to its block's largest (fp4)
    scale_of = (
        rows.abs() if fmt == "fp8" else blocks.abs().amax(-1, keepdim=True).expand(-1, -1, -1, 16).flatten(-2)
    )
    floor = rows.abs().amax(-1, keepdim=True) * 2**-9  # fp8: values below e4m3's subnormal step of the row
    assert bool(((back - rows).abs() <= bound * scale_of + (floor if fmt == "fp8" else 0)).all())
    assert bool((back[5, 0, 16:] != 0).any())  # the small blocks kept their values


def _store_step(batch, kv_dtype: str, rows: dict[str, torch.Tensor]) -> None:
    from dgpp.nn.attention import store_keys, store_kv, store_row_scaled

    store_row_scaled(batch, "latent", rows["latent"], rows["k_rot"])
    store_keys(batch, "keys", rows["keys"])
    if kv_dtype == "fp8":  # fp4 has no grouped-query K/V form
        store_kv(batch, "kv", rows["k"], rows["v"])


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_the_layers_write_in_one_launch_per_quantized_tensor(kv_dtype):
    """The MLA latent write (``store_row_scaled``), DSA index keys (``store_keys``) and e4m3 grouped-query K/V
    (``store_kv``, two KV heads) on their CUDA branch, run here through the interpreter: one launch per quantized
    tensor, no host read, and the pools hold the bytes the CPU path writes (a mixed prefill + decode step with a
    row that is not kept)."""
    from collections import Counter
    from contextlib import nullcontext

    from dgpp.bench.launches import cuda_path
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.step.cache_spec import LatentKV, PagedKV, stored_as
    from dgpp.step.pools import CachePools

    entries = {
        "latent": LatentKV.of(64, ROPE, torch.float32),
        "keys": PagedKV(1, 32, torch.float32, v_head_dim=0, fp8_rows=True, index_keys=True),
    }
    if kv_dtype == "fp8":
        entries["kv"] = PagedKV(2, 16, torch.float32, v_head_dim=24, fp8_rows=True)
    spec = stored_as(entries, kv_dtype)
    g = torch.Generator().manual_seed(8)
    work = [SeqWork(0, [0, 1, 2], 0, list(range(3, 12))), SeqWork(1, [3, 4], 5, [7])]
    tokens = 10
    shapes = {"latent": (1, 64), "k_rot": (1, ROPE), "keys": (1, 32), "k": (2, 16), "v": (2, 24)}
    rows = {name: torch.randn(tokens, *shape, generator=g) for name, shape in shapes.items()}
    rows["latent"] *= torch.logspace(-6, 6, tokens)[:, None, None]
    written = []
    for on_cuda_path in (False, True):
        pools = CachePools(spec, 6, BS, 2)
        batch = build_batch(work, pools)
        batch.slot_mapping[4] = -1  # a row whose K/V is not kept
        with cuda_path() if on_cuda_path else nullcontext() as recorder:
            if recorder is not None:
                recorder.target = launches = Counter()
            _store_step(batch, kv_dtype, rows)
            if recorder is not None:
                recorder.target = None
                assert launches == Counter({"quantized_write": 4 if kv_dtype == "fp8" else 2})
        tensors = [t for pair in (*pools.kv.values(), *pools.kv_scales.values()) for t in pair]
        written.append([t.view(torch.uint8) if t.dtype == KV_FP8 else t for t in tensors])
    for ours, ref in zip(*written, strict=True):
        assert torch.equal(ours, ref)
    latent_scales = pools.kv_scales["latent"][0]
    assert int(latent_scales.count_nonzero()) == tokens - 1  # every kept row has its scale, the other none


def test_pooled_index_key_entries_store_the_torch_encoders_bytes(monkeypatch):
    """``window_compressor.store_entries`` (GLM-5.3-Flash's pooled index keys in a prefill chunk) on its CUDA branch,
    run here through the interpreter: the codes and row scales its torch path stores."""
    from dgpp.kernels import quantized_write
    from dgpp.nn import window_compressor

    g = torch.Generator().manual_seed(9)
    rows = torch.randn(5, 16, generator=g) * torch.logspace(-4, 4, 5)[:, None]
    slots = torch.tensor([7, 0, 12, 3, 9])
    stored, launches = [], []

    def counted(*args):
        launches.append(args[2].shape)
        write_quantized_triton(*args)

    for kernel in (False, True):
        if kernel:
            for module in (window_compressor, quantized_write):
                monkeypatch.setattr(module, "use_triton", lambda x: True)
            monkeypatch.setattr(quantized_write, "write_quantized_triton", counted)
        pool = torch.zeros(4, 4, 1, 16, dtype=torch.uint8).view(KV_FP8)
        scale = torch.zeros(4, 4, 1, 1)
        window_compressor.store_entries(pool, scale, slots, rows)
        stored.append((pool.view(torch.uint8), scale))
    _assert_same_bytes(*stored)
    assert launches == [(5, 1, 16)] and int(stored[1][1].count_nonzero()) == 5
