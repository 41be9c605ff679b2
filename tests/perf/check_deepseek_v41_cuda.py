"""DeepSeek-V4.1-Flash's decode attention over its packed caches on a CUDA machine (not a CI test), at the release's
sizes (64 heads x 512 over one latent, window 128, ratio-2 groups keeping 512 entries), bf16 rows:

1. the packed compressed-decode kernel (``dgpp.kernels.compressed_decode_attention`` with ``packed`` forms: FP8 +
   E8M0 ring rows and FP4 + E4M3 entries decoded in registers) against the torch form over the decoded ring and
   pool, a row alone vs in a batch bit for bit, and its time against the torch path a V4.1 step otherwise takes
   (decode the step's rings and picked entries into bf16, then attend) and against the same kernel over rows
   decoded beforehand;
2. the indexer's scores over packed FP4 + E8M0 index keys (``dgpp.kernels.dsa_index`` with ``packed``) against
   the torch scores over the decoded keys, timed against the torch path (gather and decode each row's keys, then
   score row by row);
3. the packed ring write (``dgpp.kernels.block_scaled_ring_write``) against ``PackedFP8.encode`` byte for byte,
   timed against the torch path's decode / write / re-encode of the step's rings.

    source tests/perf/device_env.sh && python3 tests/perf/check_deepseek_v41_cuda.py

``--device cpu`` (under ``TRITON_INTERPRET=1``) runs the checks at small sizes, without meaningful times. Prints a
table last; exits non-zero when a check fails. Needs torch, triton, and the dgpp-deepseek plugin.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from check_flint_cuda import finish
from check_glm5_cuda import _timed

HEADS, LATENT, WINDOW, TOPK, RATIO, BLOCK = 64, 512, 128, 512, 2, 64
INDEX_HEADS, INDEX_DIM = 64, 128


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def _seconds(fn, device: str) -> float:
    if device == "cuda":
        return _timed(fn)
    t0 = time.perf_counter()  # a dry run off CUDA (the interpreter): the checks, not the times
    fn()
    return time.perf_counter() - t0


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter gets bf16 wrong


def _packed_inputs(batch: int, window_only: bool, max_ctx: int, device: str, seed: int) -> dict:
    """One decode row per sequence over random packed caches, contexts spread up to ``max_ctx``."""
    from dgpp.nn.compressed_decode import entry_table
    from dgpp_deepseek.v41_packed_entries import PackedFP4, PackedFP8

    g = torch.Generator(device=device).manual_seed(seed)

    def values(rows: int) -> torch.Tensor:
        return torch.randn(rows, LATENT, generator=g, device=device).to(_dtype(device))

    per_row = max_ctx // BLOCK
    tables = torch.randperm(batch * per_row, generator=g, device=device).int().view(batch, per_row)
    positions = torch.tensor(
        [min(max_ctx - 1, 600 + (2999 * r) % max_ctx) for r in range(batch)], device=device
    )
    visible = (positions + 1) // RATIO
    picks = torch.zeros(batch, TOPK, dtype=torch.int32, device=device)  # past a row's count: never read
    for r, v in enumerate(visible.tolist()):
        chosen = torch.randperm(v, generator=g, device=device)[:TOPK]
        picks[r, : chosen.numel()] = chosen.int()
    counts = visible.clamp(max=TOPK).int()
    if window_only:
        counts = torch.zeros_like(counts)
    per_block = BLOCK // RATIO
    return dict(
        q=torch.randn(batch, HEADS, LATENT, generator=g, device=device).to(_dtype(device)),
        kv=values(batch),
        ring=PackedFP8(LATENT).encode(values((batch + 1) * (WINDOW - 1))).view(batch + 1, WINDOW - 1, 1, -1),
        pool=PackedFP4(LATENT, 16, "e4m3")
        .encode(values(batch * per_row * per_block))
        .view(-1, per_block, 1, 288),
        tables=entry_table(tables, RATIO, BLOCK),
        slots=torch.arange(1, batch + 1, device=device),
        positions=positions,
        seq_lens=(positions + 1).int(),
        sinks=torch.randn(HEADS, generator=g, device=device),
        scale=LATENT**-0.5,
        ratio=RATIO,
        picks=picks,
        counts=counts,
    )


def _decoded(args: dict, slots_only: bool = False) -> dict:
    """The inputs with the ring and pool decoded to the rows' dtype (``slots_only``: the step's rings and picked entries, as
    the torch path decodes them each step; the rest left zero)."""
    from dgpp.kernels.compressed_decode_attention import entry_rows
    from dgpp_deepseek.v41_packed_entries import PackedFP4, PackedFP8

    ring_form, entry_form = PackedFP8(LATENT), PackedFP4(LATENT, 16, "e4m3")
    dtype = args["q"].dtype
    if not slots_only:
        ring = ring_form.decode(args["ring"], dtype)
        return {**args, "ring": ring, "pool": entry_form.decode(args["pool"], dtype)}
    ring = torch.zeros(*args["ring"].shape[:-1], LATENT, dtype=dtype, device=args["q"].device)
    slots = args["slots"].long()
    ring[slots] = ring_form.decode(args["ring"][slots], dtype)
    picked = entry_form.decode(entry_rows(args["pool"], args["tables"], args["picks"].long()), dtype)
    rows, k = args["picks"].shape
    pool = picked.reshape(rows * k, 1, 1, LATENT)  # each row's picks, in pick order, as a pool of its own
    tables = torch.arange(rows * k, device=pool.device).int().view(rows, k)
    picks = torch.arange(k, device=pool.device).int().expand(rows, k).contiguous()
    return {**args, "ring": ring, "pool": pool, "tables": tables, "picks": picks}


def attention_checks(failures: list[str], device: str, max_ctx: int, batches: tuple[int, ...]) -> list[str]:
    from dgpp.kernels.block_scaled_tiles import PackedKeyForms
    from dgpp.kernels.compressed_decode_attention import (
        CompressedDecodeInputs,
        compressed_decode_attention_ref,
        compressed_decode_attention_triton,
    )

    def packed(a: dict) -> torch.Tensor:
        return compressed_decode_attention_triton(CompressedDecodeInputs(**a), packed=PackedKeyForms())

    def torch_path(a: dict) -> torch.Tensor:
        return compressed_decode_attention_ref(CompressedDecodeInputs(**_decoded(a, slots_only=True)))

    out: list[str] = []
    for window_only in (False, True):
        name = "window-only" if window_only else f"ratio {RATIO}, top-{TOPK}"
        for batch in batches:
            args = _packed_inputs(batch, window_only, max_ctx, device, seed=batch + window_only)
            ours = packed(args)
            decoded = _decoded(args)
            err = rel(ours, compressed_decode_attention_ref(CompressedDecodeInputs(**decoded)))
            last = slice(batch - 1, batch)
            shared = ("ring", "pool", "sinks", "scale", "ratio")
            alone = {k: v if k in shared else v[last] for k, v in args.items()}
            same = torch.equal(packed(alone)[0], ours[-1])
            sec = _seconds(lambda a=args: packed(a), device)
            torch_sec = _seconds(lambda a=args: torch_path(a), device)
            pre_sec = _seconds(
                lambda d=decoded: compressed_decode_attention_triton(CompressedDecodeInputs(**d)), device
            )
            keys = int((args["positions"].clamp(max=WINDOW - 1) + 1 + args["counts"]).sum())
            nbytes = (
                keys * 528 + batch * (2 * HEADS + 1) * LATENT * 2
            )  # FP8 rows (entries 288 B: an upper bound)
            out.append(
                f"V4.1 packed decode attention, {name}, batch {batch}: {keys // batch} keys/row, rel err {err:.2e}, "
                f"row alone == batched: {'bit-identical' if same else 'DIFFER'}; packed kernel {sec * 1e6:.0f} us "
                f"(<= {nbytes / sec / 1e9:.0f} GB/s), torch path {torch_sec * 1e6:.0f} us, kernel over rows "
                f"decoded beforehand {pre_sec * 1e6:.0f} us"
            )
            if not (err < 1e-2 and same):
                failures.append(
                    f"V4.1 packed decode {name} batch {batch}: rel err {err:.2e}, alone==batched {same}"
                )
    return out


def index_checks(failures: list[str], device: str, max_ctx: int, batch: int) -> list[str]:
    from dgpp.kernels.block_scaled_tiles import PackedKeyForms
    from dgpp.kernels.dsa_index import index_scores_ref, index_scores_triton
    from dgpp.nn.compressed_decode import entry_table
    from dgpp_deepseek.v41_packed_entries import PackedFP4

    form = PackedFP4(INDEX_DIM, 32, "e8m0")
    g = torch.Generator(device=device).manual_seed(11)
    per_row, per_block = max_ctx // BLOCK, BLOCK // RATIO
    values = torch.randn(batch * per_row * per_block, INDEX_DIM, generator=g, device=device)
    keys = form.encode(values).view(batch * per_row, per_block, 1, -1)
    blocks = torch.randperm(batch * per_row, generator=g, device=device).int().view(batch, per_row)
    table = entry_table(blocks, RATIO, BLOCK)
    positions = torch.tensor(
        [min(max_ctx - 1, 600 + (2999 * r) % max_ctx) for r in range(batch)], device=device
    )
    seen = (positions + 1) // RATIO
    q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=g, device=device)
    w = torch.randn(batch, INDEX_HEADS, generator=g, device=device) * (INDEX_DIM * INDEX_HEADS) ** -0.5
    forms = PackedKeyForms(entry_block=32, entry_e8m0=True)

    def packed() -> torch.Tensor:
        return index_scores_triton(q, w, keys, table, seen, 1.0, packed=forms)

    def torch_path() -> list[torch.Tensor]:
        from dgpp.kernels.compressed_decode_attention import entry_rows

        out = []
        for r, n in enumerate(seen.tolist()):
            rows = form.decode(
                entry_rows(keys, table[r : r + 1], torch.arange(n, device=device)[None])[0], q.dtype
            )
            out.append((w[r, :, None] * (q[r] @ rows.t()).clamp_min(0)).sum(0))
        return out

    ours = packed()
    want = index_scores_ref(q, w, form.decode(keys, torch.float32), table, seen, 1.0)
    finite = torch.isfinite(want)
    same_mask = torch.equal(finite, torch.isfinite(ours))
    err = rel(ours[finite], want[finite])
    sec, torch_sec = _seconds(packed, device), _seconds(torch_path, device)
    if not (same_mask and err < 1e-5):
        failures.append(
            f"V4.1 packed index scores: rel err {err:.2e}, -inf where the torch scores are {same_mask}"
        )
    return [
        f"V4.1 packed index scores, batch {batch}, {int(seen.float().mean())} keys/row x {INDEX_HEADS} heads: rel err "
        f"{err:.2e}; one launch {sec * 1e6:.0f} us, torch path (gather, decode, score per row) {torch_sec * 1e6:.0f} us"
    ]


def ring_write_checks(failures: list[str], device: str, batch: int) -> list[str]:
    from dgpp.kernels.block_scaled_ring_write import ring_write_fp8_blocks_triton
    from dgpp_deepseek.v41_latent_formats import round_fp8_e8m0
    from dgpp_deepseek.v41_packed_entries import PackedFP8

    form = PackedFP8(LATENT)
    g = torch.Generator(device=device).manual_seed(7)
    kv = round_fp8_e8m0(torch.randn(batch, LATENT, generator=g, device=device).to(_dtype(device)))
    ring = torch.zeros(batch + 1, WINDOW - 1, 1, form.width, dtype=torch.uint8, device=device)
    slots = torch.arange(1, batch + 1, device=device)
    positions = torch.arange(batch, device=device) * 37 + 500
    seq_lens = (positions + 1).int()
    ring_write_fp8_blocks_triton(kv, ring, slots, positions, seq_lens)
    got = ring[slots, positions % (WINDOW - 1), 0]
    same = torch.equal(got, form.encode(kv))

    def torch_path() -> None:
        values = form.decode(ring[slots], kv.dtype)
        values[torch.arange(batch, device=device), positions % (WINDOW - 1), 0] = kv
        ring[slots] = form.encode(values)

    sec = _seconds(lambda: ring_write_fp8_blocks_triton(kv, ring, slots, positions, seq_lens), device)
    torch_sec = _seconds(torch_path, device)
    if not same:
        failures.append("V4.1 packed ring write: bytes differ from PackedFP8.encode")
    return [
        f"V4.1 packed ring write, batch {batch}: bytes == PackedFP8.encode: {same}; one launch {sec * 1e6:.0f} us, "
        f"torch decode / write / re-encode of the step's rings {torch_sec * 1e6:.0f} us"
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1 (small sizes)")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    print(torch.cuda.get_device_name() if cuda else "cpu (interpreter)", torch.__version__, flush=True)
    failures: list[str] = []
    table = attention_checks(failures, args.device, 16384 if cuda else 1024, (1, 8, 64) if cuda else (2,))
    table += index_checks(failures, args.device, 16384 if cuda else 1024, 64 if cuda else 2)
    table += ring_write_checks(failures, args.device, 64 if cuda else 2)
    return finish(table, failures)


if __name__ == "__main__":
    sys.exit(main())
