"""Core MLA and DSA layers on random weights over a real paged latent cache: the absorbed (engine) form
equals the expanded reference, rows do not depend on chunking, and the indexer's top-k pins ties low."""

from __future__ import annotations

import torch

from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.nn.dsa import DSAIndexer, index_scores, index_scores_rows, top_k_lowest_on_ties
from dgpp.nn.mla import MultiLatentAttention, mla_softmax_scale
from dgpp.nn.rotary import RotaryEmbedding
from dgpp.step.cache_spec import LatentKV
from dgpp.step.pools import CachePools

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V = 48, 4, 24, 32, 16, 8, 12


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            base = 1.0 if p.dim() == 1 else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))


def _mla() -> MultiLatentAttention:
    rotary = RotaryEmbedding(ROPE, ROPE, 10000.0, style="interleaved")
    mla = MultiLatentAttention(
        HIDDEN,
        HEADS,
        Q_LORA,
        KV_LORA,
        NOPE,
        ROPE,
        V,
        rotary,
        "attn",
        dtype=torch.float32,
        scale=mla_softmax_scale(NOPE + ROPE),
    )
    _randomize(mla, 0)
    return mla


def _run(mla, x: torch.Tensor, chunks: list[int], selection_fn=None) -> torch.Tensor:
    pools = CachePools({"attn": mla.cache_spec()}, num_blocks=8, block_size=4, num_state_slots=1)
    out, done = [], 0
    for n in chunks:
        batch = build_batch([SeqWork(0, list(range(8)), done, list(range(n)))], pools)
        query = mla.prepare(x[done : done + n], batch)
        picks = None if selection_fn is None else selection_fn(done, n)
        out.append(mla.attend(query, batch, picks))
        done += n
    return torch.cat(out)


def test_latent_cache_spec_holds_latent_and_rope_per_token():
    spec = _mla().cache_spec()
    assert spec == LatentKV.of(KV_LORA, ROPE, torch.float32)
    assert spec.bytes_per_token() == (KV_LORA + ROPE) * 4
    pools = CachePools({"attn": spec}, num_blocks=2, block_size=4, num_state_slots=1)
    latent, rope = pools.kv["attn"]
    assert latent.shape == (2, 4, 1, KV_LORA) and rope.shape == (2, 4, 1, ROPE)


def test_absorbed_equals_expanded_dense_and_selected():
    mla = _mla()
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(1))

    def picks(start: int, n: int):  # every other visible token for rows past position 6
        return [torch.arange(0, start + r + 1, 2) if start + r > 6 else None for r in range(n)]

    for fn in (None, picks):
        absorbed = _run(mla, x, [21], fn)
        mla.absorbed = False
        expanded = _run(mla, x, [21], fn)
        mla.absorbed = True
        assert (absorbed - expanded).abs().max() <= 1e-5 * expanded.abs().max()
    assert (_run(mla, x, [21], picks) - _run(mla, x, [21])).abs().max() > 1e-3  # the selection is honoured


def test_rows_do_not_depend_on_chunking():
    mla = _mla()
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(2))
    one_shot = _run(mla, x, [17])
    assert torch.equal(_run(mla, x, [5, 1, 7, 4]), one_shot)
    assert torch.equal(_run(mla, x, [1] * 17), one_shot)


def test_top_k_pins_ties_to_the_lower_position():
    scores = torch.tensor([0.0, 2.0, 0.0, 1.0, 2.0, 0.0, 0.0])
    assert top_k_lowest_on_ties(scores, 3).tolist() == [1, 3, 4]
    assert top_k_lowest_on_ties(scores, 4).tolist() == [0, 1, 3, 4]
    assert top_k_lowest_on_ties(torch.zeros(6), 2).tolist() == [0, 1]


def test_a_keys_index_score_does_not_depend_on_how_many_keys_or_rows_are_scored():
    """A decode step scores every entry its batch's table could hold for every row at once, a verify or prefill
    row only the entries it sees, the reference one row at a time: each key's score must have the same bits in
    all of them, or they pick different entries on a near-tie."""
    gen = torch.Generator().manual_seed(3)
    q, keys, weights = (torch.randn(*shape, generator=gen) for shape in ((5, 16, 16), (5, 300, 16), (5, 16)))
    every = index_scores_rows(q, keys, weights)
    for n in (1, 15, 16, 17, 23, 25, 31, 64, 127, 128, 129, 200):
        assert torch.equal(index_scores_rows(q[1:4], keys[1:4, :n], weights[1:4]), every[1:4, :n]), n
        assert torch.equal(index_scores(q[2], keys[2, :n], weights[2]), every[2, :n]), n


def test_indexer_is_dense_up_to_topk_then_selects_topk_causally():
    rotary = RotaryEmbedding(16, ROPE, 10000.0, style="interleaved")
    indexer = DSAIndexer(HIDDEN, Q_LORA, 16, 16, 5, rotary, "ix", dtype=torch.float32)
    _randomize(indexer, 3)
    gen = torch.Generator().manual_seed(4)
    x, q_resid = torch.randn(12, HIDDEN, generator=gen), torch.randn(12, Q_LORA, generator=gen)
    pools = CachePools({"ix": indexer.cache_spec()}, num_blocks=4, block_size=4, num_state_slots=1)
    selection = indexer(x, q_resid, build_batch([SeqWork(0, [0, 1, 2, 3], 0, list(range(12)))], pools))
    assert selection[:5] == [None] * 5
    for pos in range(5, 12):
        picked = selection[pos]
        assert picked is not None and len(picked) == 5 and int(picked.max()) <= pos
        assert torch.equal(picked, picked.sort().values)
