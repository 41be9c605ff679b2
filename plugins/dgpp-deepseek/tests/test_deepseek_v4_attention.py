"""DeepSeek-V4 attention, one layer at a time, against transformers' ``DeepseekV4Attention``: a sliding layer,
an HCA layer (non-overlapping windows, every complete entry attended) and a CSA layer (overlapping windows,
the lightning indexer's top-k), with windows, ratios and ``index_topk`` smaller than the prompt. The same rows
prefilled in one step, in chunks, or batched with another sequence give the same bits."""

from __future__ import annotations

import pytest
import torch
import transformers

from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.step.pools import CachePools
from dgpp_deepseek.attention import DeepseekV4Attention
from dgpp_deepseek.config import DeepseekV4ArchConfig
from dgpp_deepseek.testing import tiny_deepseek_v4_config

transformers.logging.set_verbosity_error()
LAYER_TYPES = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
CONFIG = tiny_deepseek_v4_config(num_hidden_layers=3, layer_types=LAYER_TYPES, mlp_layer_types=["moe"] * 3)
HF_TO_OURS = [
    ("q_a_proj", "wq_a"),
    ("q_a_norm", "q_norm"),
    ("q_b_proj", "wq_b"),
    ("kv_proj", "wkv"),
    ("kv_norm", "kv_norm"),
    ("o_a_proj", "wo_a"),
    ("o_b_proj", "wo_b"),
    ("sinks", "attn_sink"),
]
COMPRESSOR = [("kv_proj", "wkv"), ("gate_proj", "wgate"), ("position_bias", "ape"), ("kv_norm", "norm")]


def _ours_name(hf: str) -> str:
    parts = hf.split(".")
    if parts[0] == "compressor" and len(parts) > 1 and parts[1] == "indexer":
        rest = ".".join(parts[2:])
        for a, b in (("q_b_proj", "wq_b"), ("scorer.weights_proj", "weights_proj")):
            if rest.startswith(a):
                return "indexer." + b + rest[len(a) :]
        prefix, rest = "indexer.compressor.", rest
    elif parts[0] == "compressor":
        prefix, rest = "compressor.", ".".join(parts[1:])
    else:
        prefix, rest = "", hf
    table = COMPRESSOR if prefix else HF_TO_OURS
    for a, b in table:
        if rest.startswith(a):
            return prefix + b + rest[len(a) :]
    raise KeyError(hf)


@pytest.fixture(scope="module")
def layers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HFAttention

    hf_cfg = DeepseekV4Config(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")})
    cfg = DeepseekV4ArchConfig.from_hf_config(hf_cfg.to_dict())
    gen = torch.Generator().manual_seed(0)
    pairs = []
    for idx in range(3):
        ref = HFAttention(hf_cfg, idx).eval()
        ours = DeepseekV4Attention(cfg, idx, dtype=torch.float32)
        theirs = dict(ref.named_parameters())
        with torch.no_grad():
            for name, p in theirs.items():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
                if name.endswith("norm.weight"):
                    p.add_(1.0)
            ours_params = dict(ours.named_parameters())
            for name, p in theirs.items():
                ours_params[_ours_name(name)].copy_(p)
        pairs.append((ours, ref, hf_cfg))
    return pairs


def _reference(ref, hf_cfg, x: torch.Tensor) -> torch.Tensor:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    n = x.shape[0]
    pos = torch.arange(n)[None]
    rotary = DeepseekV4RotaryEmbedding(hf_cfg)
    emb = {k: rotary(x[None], pos, layer_type=k) for k in ("main", "compress")}
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    visible = (j <= i) & (j > i - hf_cfg.sliding_window)
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        return ref(x[None], emb, pos, mask, None)[0][0]


def _ours(layer, xs: list[torch.Tensor], chunk: int | None = None) -> list[torch.Tensor]:
    """Each sequence of rows ``xs`` run together, in steps of ``chunk`` rows (or whole)."""
    spec = layer.cache_entries(torch.float32)
    block_size = 16
    tables = []
    next_block = 0
    for x in xs:
        n = -(-x.shape[0] // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    pools = CachePools(spec, next_block, block_size, len(xs))
    outs: list[list[torch.Tensor]] = [[] for _ in xs]
    done = [0] * len(xs)
    with torch.no_grad():
        while any(d < x.shape[0] for d, x in zip(done, xs, strict=True)):
            live = [i for i, x in enumerate(xs) if done[i] < x.shape[0]]
            work, rows = [], []
            for i in live:
                step = xs[i].shape[0] - done[i] if chunk is None else min(chunk, xs[i].shape[0] - done[i])
                work.append(SeqWork(i, tables[i], done[i], [0] * step))
                rows.append(xs[i][done[i] : done[i] + step])
            out = layer(torch.cat(rows), build_batch(work, pools))
            for i, part in zip(live, out.split([r.shape[0] for r in rows]), strict=True):
                outs[i].append(part)
                done[i] += part.shape[0]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYER_TYPES)
def test_layer_matches_transformers(layers, idx):
    ours, ref, hf_cfg = layers[idx]
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(idx))
    expected = _reference(ref, hf_cfg, x)
    got = _ours(ours, [x])[0]
    assert (got - expected).abs().max() / expected.abs().max() < 1e-5


@pytest.mark.parametrize("idx", [0, 1, 2], ids=LAYER_TYPES)
def test_chunked_and_batched_rows_are_the_same_bits(layers, idx):
    ours = layers[idx][0]
    gen = torch.Generator().manual_seed(10 + idx)
    x, other = torch.randn(37, 64, generator=gen), torch.randn(21, 64, generator=gen)
    whole = _ours(ours, [x])[0]
    for chunk in (1, 3, 8):
        assert torch.equal(_ours(ours, [x, other], chunk=chunk)[0], whole)


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("idx", [1, 2], ids=LAYER_TYPES[1:])
def test_batched_decode_path_matches_the_reference(layers, idx, fused):
    """The CUDA-graph-safe decode path (``dgpp.nn.compressed_decode``; its torch forms, or the Triton kernels under
    the interpreter) against the per-row reference, step by step from prompts of 3 and 26 rows past several
    window closes: same outputs within 1e-5, same cache contents."""
    ours = layers[idx][0]
    gen = torch.Generator().manual_seed(20 + idx)
    seqs = [torch.randn(3 + 12, 64, generator=gen), torch.randn(26 + 12, 64, generator=gen)]
    prompts = [3, 26]
    results = []
    for batched in (False, True):
        ours.core.batched_decode, ours.core.fused_decode = batched, fused
        try:
            spec = ours.cache_entries(torch.float32)
            pools = CachePools(spec, 6, 16, 2)
            tables = [[0, 1, 2], [3, 4, 5]]
            outs = []
            with torch.no_grad():
                ours(
                    torch.cat([s[:n] for s, n in zip(seqs, prompts, strict=True)]),
                    build_batch([SeqWork(i, tables[i], 0, [0] * n) for i, n in enumerate(prompts)], pools),
                )
                for step in range(12):
                    work = [SeqWork(i, tables[i], n + step, [0]) for i, n in enumerate(prompts)]
                    rows = torch.stack([s[n + step] for s, n in zip(seqs, prompts, strict=True)])
                    outs.append(ours(rows, build_batch(work, pools)))
            results.append((torch.stack(outs), pools))
        finally:
            ours.core.batched_decode = ours.core.fused_decode = None
    (ref, ref_pools), (got, got_pools) = results
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5
    for name in ref_pools.kv:
        torch.testing.assert_close(got_pools.kv[name][0], ref_pools.kv[name][0], rtol=0, atol=1e-5)
    for name in ref_pools.state:
        for t in ref_pools.state[name]:
            torch.testing.assert_close(got_pools.state[name][t], ref_pools.state[name][t], rtol=0, atol=1e-5)


def _prefill_then_decode(layer, seqs: list[torch.Tensor], prompts: list[int], chunk: int, steps: int):
    """Prompts prefilled in steps of ``chunk`` rows (both sequences in each step), then ``steps`` decode steps:
    (prefill rows, decode rows, pools)."""
    pools = CachePools(layer.cache_entries(torch.float32), 8, 16, 2)
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]
    prefill: list[list[torch.Tensor]] = [[], []]
    done = [0, 0]
    with torch.no_grad():
        while any(d < n for d, n in zip(done, prompts, strict=True)):
            live = [i for i in range(2) if done[i] < prompts[i]]
            take = [min(chunk, prompts[i] - done[i]) for i in live]
            work = [SeqWork(i, tables[i], done[i], [0] * t) for i, t in zip(live, take, strict=True)]
            rows = torch.cat([seqs[i][done[i] : done[i] + t] for i, t in zip(live, take, strict=True)])
            for i, part in zip(live, layer(rows, build_batch(work, pools)).split(take), strict=True):
                prefill[i].append(part)
                done[i] += part.shape[0]
        decode = []
        for step in range(steps):
            work = [SeqWork(i, tables[i], n + step, [0]) for i, n in enumerate(prompts)]
            rows = torch.stack([s[n + step] for s, n in zip(seqs, prompts, strict=True)])
            decode.append(layer(rows, build_batch(work, pools)))
    return (
        torch.cat([torch.cat(p) for p in prefill]),
        torch.stack(decode) if decode else torch.empty(0),
        pools,
    )


@pytest.mark.parametrize("idx", [1, 2], ids=LAYER_TYPES[1:])
def test_batched_prefill_is_the_per_row_reference(layers, idx):
    """The prefill path batched over a chunk's rows (``dgpp.nn.compressed_prefill``) against the per-row
    reference, prompts of 45 and 27 rows (the indexer keeps 3 of up to 11 entries) in chunks of 5 that cut
    inside windows: the same bits in every row, every cache entry and ring, and in 6 decode steps after."""
    ours = layers[idx][0]
    gen = torch.Generator().manual_seed(30 + idx)
    seqs = [torch.randn(51, 64, generator=gen), torch.randn(33, 64, generator=gen)]
    results = []
    for per_row in (True, False):
        ours.core.per_row_prefill = per_row
        try:
            results.append(_prefill_then_decode(ours, seqs, [45, 27], chunk=5, steps=6))
        finally:
            ours.core.per_row_prefill = False
    (ref, ref_decode, ref_pools), (got, got_decode, got_pools) = results
    assert torch.equal(got, ref) and torch.equal(got_decode, ref_decode)
    for name in ref_pools.kv:
        assert torch.equal(got_pools.kv[name][0], ref_pools.kv[name][0])
    for name in ref_pools.state:
        for t in ref_pools.state[name]:
            assert torch.equal(got_pools.state[name][t], ref_pools.state[name][t])


def test_later_rows_leave_earlier_rows_alone(layers):
    """Causality through the whole CSA prefill (compressors, indexer, attention): changing rows 30.. of a
    one-shot prompt leaves rows ..29 bit for bit, and moves row 30 on."""
    ours = layers[2][0]
    x = torch.randn(45, 64, generator=torch.Generator().manual_seed(40))
    changed = x.clone()
    changed[30:] += 1.0
    base, moved = _ours(ours, [x])[0], _ours(ours, [changed])[0]
    assert torch.equal(moved[:30], base[:30]) and float((moved[30:] - base[30:]).abs().max()) > 1e-3


@pytest.mark.parametrize("idx", [1, 2], ids=LAYER_TYPES[1:])
def test_cuda_prefill_path_under_the_interpreter(layers, idx, monkeypatch):
    """What a CUDA prefill step runs (the indexer's scores from ``dgpp.kernels.dsa_index`` over the index pool and
    the per-row radix select of ``dgpp.kernels.top_k_rows``, the compressed-attention kernel), here on CPU tensors under the Triton interpreter:
    within fp32 rounding of the per-row reference, and chunks of 5 give one shot's bits."""
    import dgpp.kernels.compressed_attention as kernel
    import dgpp.nn.compressed_prefill as prefill

    ours = layers[idx][0]
    gen = torch.Generator().manual_seed(50 + idx)
    seqs = [torch.randn(51, 64, generator=gen), torch.randn(33, 64, generator=gen)]
    ours.core.per_row_prefill = True
    try:
        ref = _prefill_then_decode(ours, seqs, [45, 27], chunk=45, steps=0)[0]
    finally:
        ours.core.per_row_prefill = False
    for module in (kernel, prefill):
        monkeypatch.setattr(module, "use_triton", lambda x: True)
    whole = _prefill_then_decode(ours, seqs, [45, 27], chunk=45, steps=0)[0]
    assert (whole - ref).abs().max() / ref.abs().max() < 1e-5
    assert torch.equal(_prefill_then_decode(ours, seqs, [45, 27], chunk=5, steps=0)[0], whole)
