"""CPU decode paths keep a row's bits independent of the rows beside it (solo == batched == chunked)."""

from __future__ import annotations

import pytest
import torch

from dgpp.nn.mlp import silu_and_mul

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 64, 576, 1536, 3072])
def test_swiglu_row_alone_equals_the_row_among_many(dtype, width):
    total = 300
    gate = (torch.randn(total, width, generator=GEN) * 4).to(dtype)
    up = torch.randn(total, width, generator=GEN).to(dtype)
    full = silu_and_mul(gate, up)
    for rows in [*range(1, 12), 31, 63, 64, 65, 100, total]:
        assert torch.equal(silu_and_mul(gate[:rows], up[:rows]), full[:rows]), rows
    for row in range(0, total, 7):
        assert torch.equal(silu_and_mul(gate[row : row + 1], up[row : row + 1]), full[row : row + 1]), row
    # the halves of one fused gate/up product: a strided gate of a few rows takes the contiguous path
    fused = torch.cat([gate, up], dim=1)
    for rows in [1, 2, 3, 5, 11, 64, total]:
        halves = fused[:rows, :width], fused[:rows, width:]
        assert torch.equal(silu_and_mul(*halves), full[:rows]), rows


@pytest.mark.parametrize("outs, width", [(49152, 576), (3072, 576), (960, 576), (576, 1536), (2000, 1000)])
def test_tiled_rows_are_the_row_alone(outs, width):
    """A weight of two or more cache-sized slices is multiplied a slice at a time by several rows: each row's
    bits are its one-row product against the whole weight."""
    from dgpp.nn.batch_invariant import TILE_BYTES, row_products, tile_features

    weight = torch.randn(outs, width, generator=GEN)
    x = torch.randn(20, width, generator=GEN)
    alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], weight) for i in range(20)])
    tile = tile_features(weight)
    assert tile > 0 and tile * width * 4 <= TILE_BYTES and 2 * tile <= outs  # the tiled path runs
    for rows in [1, 2, 3, 4, 5, 7, 16, 20]:
        assert torch.equal(row_products(x[:rows], weight), alone[:rows]), rows


def test_a_weight_of_under_two_slices_is_read_whole():
    from dgpp.nn.batch_invariant import tile_features

    assert tile_features(torch.zeros(576, 576)) == 0 and tile_features(torch.zeros(64, 64)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outs, width", [((576, 192, 192), 576), ((1536, 1536), 576), ((40, 8, 8), 32)])
def test_fused_projection_rows_do_not_depend_on_the_row_count(dtype, outs, width):
    from dgpp.nn.batch_invariant import ROW_BATCH, batch_invariant_fused_linear

    weights = tuple(
        torch.nn.Parameter(torch.randn(n, width, generator=GEN).to(dtype), requires_grad=False) for n in outs
    )
    x = torch.randn(ROW_BATCH + 9, width, generator=GEN).to(dtype)
    full = batch_invariant_fused_linear(x, weights)
    separate = torch.cat([torch.nn.functional.linear(x.float(), w.float()) for w in weights], -1).to(dtype)
    torch.testing.assert_close(full, separate, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    for rows in [1, 2, 3, 5, 16, 17, ROW_BATCH, ROW_BATCH + 9]:
        assert torch.equal(batch_invariant_fused_linear(x[:rows], weights), full[:rows]), rows
    for row in range(0, x.shape[0], 11):
        assert torch.equal(batch_invariant_fused_linear(x[row : row + 1], weights), full[row : row + 1]), row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_weights_follow_in_place_updates(dtype):
    from dgpp.nn.batch_invariant import batch_invariant_fused_linear

    weights = tuple(
        torch.nn.Parameter(torch.randn(n, 16, generator=GEN).to(dtype), requires_grad=False) for n in (32, 16)
    )
    x = torch.randn(3, 16, generator=GEN).to(dtype)
    batch_invariant_fused_linear(x, weights)
    with torch.no_grad():
        weights[1].mul_(2)
    want = torch.cat([torch.nn.functional.linear(x.float(), w.float()) for w in weights], -1).to(dtype)
    torch.testing.assert_close(batch_invariant_fused_linear(x, weights), want, rtol=1e-2, atol=1e-3)
    if dtype == torch.float32:  # fp32 parameters live in the fused tensor: no second copy of the weights
        fused = weights[0]._dgpp_fused[1]
        assert (
            weights[0].data_ptr() == fused.data_ptr()
            and weights[1].untyped_storage().data_ptr() == fused.data_ptr()
        )


@pytest.mark.parametrize("out_features, in_features", [(96, 576), (576, 1536), (48, 1536), (576, 3072)])
def test_narrow_weights_take_the_native_product_where_rows_stay_exact(out_features, in_features):
    """bf16 parameters multiply natively, against a packed copy where oneDNN packs; every row of a call equals
    the row alone. On an AVX512-BF16 CPU 576 x 1536 is exact only in calls of one or two rows (the row limit):
    without it the batched rows below differ from the row alone."""
    from dgpp.nn.batch_invariant import (
        ROW_BATCH,
        _can_pack,
        _native_verdict,
        batch_invariant_linear,
        native_row_limit,
    )

    w = torch.nn.Parameter(
        torch.randn(out_features, in_features, generator=GEN).to(torch.bfloat16), requires_grad=False
    )
    x = torch.randn(ROW_BATCH + 9, in_features, generator=GEN).to(torch.bfloat16)
    assert native_row_limit(torch.float32, out_features, in_features) == 0
    out = batch_invariant_linear(x, w)
    if native_row_limit(torch.bfloat16, out_features, in_features):  # this CPU's bf16 kernel passed the check
        alone = torch.cat([torch.nn.functional.linear(x[i : i + 1], w) for i in range(x.shape[0])])
        assert torch.equal(out, alone)
        # the packed copy exists where this CPU packs and the packed call kept the rows' bits (the verdict)
        packs = _native_verdict(torch.bfloat16, out_features, in_features)[1]
        assert (getattr(w, "_dgpp_packed", (None, None))[1] is not None) == packs
        assert not packs or _can_pack(torch.bfloat16)
    else:
        # the fp32 path: each row widened exactly, its one-row fp32 product rounded once
        alone = torch.cat(
            [torch.nn.functional.linear(x[i : i + 1].float(), w.float()) for i in range(x.shape[0])]
        )
        assert torch.equal(out, alone.to(torch.bfloat16))
    for rows in [*range(1, 12), 17, 64, ROW_BATCH, ROW_BATCH + 9]:
        assert torch.equal(batch_invariant_linear(x[:rows], w), out[:rows]), rows
    for row in range(0, x.shape[0], 7):
        assert torch.equal(batch_invariant_linear(x[row : row + 1], w), out[row : row + 1]), row
    with torch.no_grad():
        w.mul_(2)  # the packed copy is rebuilt after an in-place change
    assert torch.equal(batch_invariant_linear(x[:5], w), (out[:5].float() * 2).to(torch.bfloat16))


def test_fusing_in_inference_mode_leaves_the_parameters_ordinary_tensors():
    from dgpp.nn.batch_invariant import batch_invariant_fused_linear

    weights = tuple(
        torch.nn.Parameter(torch.randn(n, 16, generator=GEN), requires_grad=False) for n in (32, 16)
    )
    x = torch.randn(2, 16, generator=GEN)
    with torch.inference_mode():  # as the runner steps
        first = batch_invariant_fused_linear(x, weights)
        assert torch.equal(batch_invariant_fused_linear(x, weights), first)
    assert not any(w.is_inference() for w in weights)
    with torch.no_grad():
        weights[0].zero_()  # still an ordinary parameter: in-place updates work and are followed
    assert torch.equal(batch_invariant_fused_linear(x, weights)[:, :32], torch.zeros(2, 32))


def test_cpu_rotary_angles_are_computed_once_a_step():
    from dgpp.nn.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(64, 64, 1e4)
    with torch.inference_mode():
        positions = torch.arange(7)
        first = rotary.cos_sin(positions, torch.bfloat16)
        again = rotary.cos_sin(positions, torch.bfloat16)  # the next layer of the same step
        assert again[0] is first[0] and again[1] is first[1]
        fresh = rotary.cos_sin(torch.arange(7), torch.bfloat16)  # the next step's positions
        assert (
            fresh[0] is not first[0] and torch.equal(fresh[0], first[0]) and torch.equal(fresh[1], first[1])
        )
        assert rotary.cos_sin(positions, torch.float32)[0].dtype == torch.float32
    shifted = torch.arange(7)
    rotary.cos_sin(shifted, torch.float32)
    shifted += 3  # changed in place: computed afresh
    assert torch.equal(
        rotary.cos_sin(shifted, torch.float32)[0], rotary.cos_sin(torch.arange(3, 10), torch.float32)[0]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_of_a_sequence_alone_equals_it_among_others(dtype):
    """A single-sequence step (its own path: no output scatter) gives each row the bits that row gets in a
    step with other sequences, and two layers of one step (sharing the step's write slots and context rows)
    each read their own pool entry."""
    from dgpp.engine.runner import build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.nn.attention import PagedAttention
    from dgpp.step.cache_spec import PagedKV
    from dgpp.step.pools import CachePools

    hq, hkv, d, bs = 6, 2, 16, 4
    tables, contexts, new = [[3, 0, 5], [1, 4]], [0, 5], [9, 1]  # a prefill of 9 rows, a decode row at 5
    keys = [torch.randn(c + n, hkv, d, generator=GEN).to(dtype) for c, n in zip(contexts, new, strict=True)]
    values = [torch.randn(c + n, hkv, d, generator=GEN).to(dtype) for c, n in zip(contexts, new, strict=True)]
    queries = [torch.randn(n, hq, d, generator=GEN).to(dtype) for n in new]

    def run(seqs: list[int]) -> list[torch.Tensor]:
        pools = CachePools({name: PagedKV(hkv, d, dtype) for name in ("a", "b")}, 8, bs, 1)
        for name in ("a", "b"):
            k_cache, v_cache = pools.kv[name]
            for i in seqs:  # the earlier tokens, as an earlier step left them
                for pos in range(contexts[i]):
                    block, offset = tables[i][pos // bs], pos % bs
                    k_cache[block, offset], v_cache[block, offset] = keys[i][pos], values[i][pos]
        batch = build_batch([SeqWork(0, tables[i], contexts[i], [0] * new[i]) for i in seqs], pools)
        q = torch.cat([queries[i] for i in seqs])
        k = torch.cat([keys[i][contexts[i] :] for i in seqs])
        v = torch.cat([values[i][contexts[i] :] for i in seqs])
        first = PagedAttention("a", hq, hkv, d)(q, k, v, batch)
        second = PagedAttention("b", hq, hkv, d)(q, k * 2, v * 2, batch)  # another layer, the same step
        assert not torch.equal(first, second)
        return list(first.split([new[i] for i in seqs])) + list(second.split([new[i] for i in seqs]))

    together = run([0, 1])
    alone = [run([0]), run([1])]
    assert torch.equal(alone[0][0], together[0]) and torch.equal(alone[1][0], together[1])
    assert torch.equal(alone[0][1], together[2]) and torch.equal(alone[1][1], together[3])


def test_bf16_llama_decode_alone_equals_batched_and_chunked(tmp_path):
    """A whole bf16 model on the CPU (packed products, a 1536-wide ``down_proj`` one row a call, the step's
    rotation, norms and attention): a sequence's logits are bit-identical decoded alone, beside another
    sequence, and after its prompt was prefilled in chunks."""
    pytest.importorskip("dgpp_llama", reason="the example plugin is installed by scripts/setup.sh")
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.startup.loading import load_model
    from dgpp.step.pools import CachePools
    from dgpp.testing.builders import build_tiny_checkpoint

    overrides = {"intermediate_size": 1536, "tie_word_embeddings": True, "hidden_size": 96, "head_dim": 24}
    checkpoint = build_tiny_checkpoint("llama", tmp_path / "llama", overrides=overrides)
    model = load_model(checkpoint, dtype=torch.bfloat16)
    prompts = [[(13 * i + 5) % 512 for i in range(11)], [(7 * i + 3) % 512 for i in range(7)]]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7]]

    def decode(seqs: list[int], chunk: int, steps: int = 5) -> list[list[torch.Tensor]]:
        runner = ModelRunner(model, CachePools(model.cache_spec(), 8, 4, 2))
        logits: list[list[torch.Tensor]] = [[] for _ in seqs]
        done = 0
        while done < len(prompts[seqs[0]]):  # the prompts in chunks (the last row of each prompt is sampled)
            works = [SeqWork(j, tables[s], done, prompts[s][done : done + chunk]) for j, s in enumerate(seqs)]
            works = [w for w in works if w.token_ids]
            out = runner.step(works)
            done += chunk
            for j, s in enumerate(seqs):
                if done >= len(prompts[s]) > done - chunk:
                    logits[j].append(out[[w.state_slot for w in works].index(j)])
        for _ in range(steps):
            works = [
                SeqWork(j, tables[s], len(prompts[s]) + len(logits[j]) - 1, [int(logits[j][-1].argmax())])
                for j, s in enumerate(seqs)
            ]
            for j, row in enumerate(runner.step(works)):
                logits[j].append(row)
        return logits

    alone = decode([0], chunk=16)[0]
    assert all(torch.equal(a, b) for a, b in zip(alone, decode([0, 1], chunk=16)[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(alone, decode([0], chunk=4)[0], strict=True))


def test_a_packed_product_that_differs_from_the_plain_row_is_not_used(monkeypatch):
    """Packing is kept only where the packed product gives each row the plain one-row ``F.linear``'s bits: a
    packed layout whose rows differ (simulated: the packed copy of another weight) is refused and the plain
    native product serves the weight."""
    from dgpp.nn import batch_invariant

    real_pack = batch_invariant._pack
    monkeypatch.setattr(batch_invariant, "_native_verdicts", {})
    monkeypatch.setattr(
        batch_invariant, "_pack", lambda w: None if real_pack(w) is None else real_pack(w * 2)
    )
    w = torch.nn.Parameter(torch.randn(64, 96, generator=GEN).to(torch.bfloat16), requires_grad=False)
    x = torch.randn(5, 96, generator=GEN).to(torch.bfloat16)
    limit, packed = batch_invariant._native_verdict(torch.bfloat16, 64, 96)
    assert not packed and limit in (0, batch_invariant.ROW_BATCH)
    if limit:
        assert torch.equal(batch_invariant.batch_invariant_linear(x, w), torch.nn.functional.linear(x, w))
