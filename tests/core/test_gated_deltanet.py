"""Gated delta rule (chunked prefill + recurrent decode over pooled state) vs transformers' torch fallbacks, fp32."""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from dgpp.nn.gated_delta_rule import gated_delta_rule_rows
from dgpp.nn.gated_deltanet import GatedRMSNorm, gated_delta_rule_varlen

HK, HV, DK, DV = 2, 4, 8, 6


def _inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HK, DK, generator=gen)
    k = torch.randn(length, HK, DK, generator=gen)
    v = torch.randn(length, HV, DV, generator=gen)
    g = -torch.rand(length, HV, generator=gen) * 2.0  # log decay <= 0
    beta = torch.rand(length, HV, generator=gen)
    return q, k, v, g, beta


def _reference(seq, initial_state):
    q, k, v, g, beta = (x[None] for x in seq)
    out, state = torch_recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[0], state[0]


def _run(seqs, splits, chunk_size, pool, slots, start_ctx):
    done = list(start_ctx)
    base = list(start_ctx)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(max(len(s) for s in splits)):
        live = [i for i in range(len(seqs)) if step < len(splits[i])]
        q_lens = [splits[i][step] for i in live]
        parts = [
            tuple(x[done[i] - base[i] : done[i] - base[i] + n] for x in seqs[i])
            for i, n in zip(live, q_lens, strict=False)
        ]
        flat = [torch.cat([p[j] for p in parts]) for j in range(5)]
        y = gated_delta_rule_varlen(*flat, pool, slots[live], q_lens, [done[i] for i in live], chunk_size)
        for i, piece in zip(live, torch.split(y, q_lens), strict=False):
            outs[i].append(piece)
            done[i] += piece.shape[0]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize(
    "splits",
    [
        [[23], [1], [9]],
        [[5, 11, 1, 1, 1], [1, 1, 1, 1], [2, 7]],
        [[1] * 10, [16, 3], [4, 4, 4, 1]],
    ],
)
def test_varlen_matches_recurrent_reference(splits, chunk_size):
    seqs = [_inputs(sum(s), seed=i) for i, s in enumerate(splits)]
    pool = torch.randn(6, HV, DK, DV)  # garbage: fresh sequences must start from zeros
    slots = torch.tensor([4, 0, 2])
    outs = _run(seqs, splits, chunk_size, pool, slots, [0, 0, 0])
    for seq, out, slot in zip(seqs, outs, slots, strict=False):
        ref_out, ref_state = _reference(seq, torch.zeros(HV, DK, DV))
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pool[slot], ref_state, rtol=1e-4, atol=1e-5)


def test_continues_from_slot_state():
    """A sequence with context > 0 starts from what its slot holds (e.g. a restored snapshot)."""
    seq = _inputs(13, seed=7)
    initial = torch.randn(HV, DK, DV) * 0.3
    pool = torch.zeros(3, HV, DK, DV)
    pool[1] = initial
    (out,) = _run([seq], [[6, 1, 6]], 4, pool, torch.tensor([1]), [40])
    ref_out, ref_state = _reference(seq, initial)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[1], ref_state, rtol=1e-4, atol=1e-5)


def test_chunked_matches_transformers_chunked_form():
    seq = _inputs(150, seed=3)
    initial = torch.randn(HV, DK, DV) * 0.3
    pool = initial[None].clone()
    out = gated_delta_rule_varlen(*seq, pool, torch.tensor([0]), [150], [1])
    q, k, v, g, beta = (x[None] for x in seq)
    ref, state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[0], state[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_transformers(dtype):
    torch.manual_seed(0)
    norm = Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm = norm.to(dtype)
    ours = GatedRMSNorm(DV, 1e-6, dtype=dtype)
    ours.weight.copy_(norm.weight.detach())
    x, z = torch.randn(10, DV, dtype=dtype), torch.randn(10, DV, dtype=dtype)
    # within an fp32 ulp or two: the gate's silu runs where a row's bits do not depend on the rows beside it (the
    # CPU's vector body), transformers' over the tensor as it comes (its tail elements on the scalar path)
    torch.testing.assert_close(ours(x, z), norm(x, z), rtol=3e-7, atol=1e-7)


def test_batch_composition_does_not_change_a_sequence_bitwise():
    """Batch invariance: a sequence's outputs and final state are bit-identical alone and inside a batch that
    mixes longer prefills and decode rows (each sequence's chunks and steps are computed on their own)."""
    seqs = [_inputs(n, seed=20 + i) for i, n in enumerate((37, 1, 100, 1))]
    base = torch.randn(5, HV, DK, DV, generator=torch.Generator().manual_seed(3)) * 0.3

    def run(members: list[int], slots: list[int], ctx: list[int]):
        pool = base.clone()
        flat = [torch.cat([seqs[i][j] for i in members]) for j in range(5)]
        q_lens = [seqs[i][0].shape[0] for i in members]
        return gated_delta_rule_varlen(*flat, pool, torch.tensor(slots), q_lens, ctx).split(q_lens), pool

    (alone_prefill,), pool_a = run([0], [2], [3])
    (alone_decode,), pool_b = run([1], [4], [9])
    mixed, pool_m = run([3, 0, 2, 1], [0, 2, 1, 4], [5, 3, 0, 9])
    assert torch.equal(mixed[1], alone_prefill) and torch.equal(pool_m[2], pool_a[2])
    assert torch.equal(mixed[3], alone_decode) and torch.equal(pool_m[4], pool_b[4])


@pytest.mark.parametrize("per_channel", [False, True])
def test_row_form_is_the_same_bits_however_the_prompt_is_cut_or_batched(per_channel):
    """The CPU's canonical form: every row one recurrent step, so a sequence's outputs and state are bit-identical
    one-shot, in any cut into prefill chunks, and beside other sequences (prefills and decode rows of other
    lengths: the per-row gates sit at other offsets of the step's tensors); and it is the recurrence transformers
    writes, to fp32 rounding."""
    lengths = (37, 1, 100, 5)
    seqs = [list(_inputs(n, seed=40 + i)) for i, n in enumerate(lengths)]
    if per_channel:  # KDA: a log-decay per head and key channel
        for i, n in enumerate(lengths):
            seqs[i][3] = -torch.rand(n, HV, DK, generator=torch.Generator().manual_seed(60 + i))
    base = torch.randn(5, HV, DK, DV, generator=torch.Generator().manual_seed(3)) * 0.3

    def run(members: list[int], cuts: list[list[int]], slots: list[int], ctx: list[int]):
        pool, outs, done = base.clone(), [[] for _ in members], [0] * len(members)
        for step in range(max(len(c) for c in cuts)):
            live = [m for m in range(len(members)) if step < len(cuts[m])]
            q_lens = [cuts[m][step] for m in live]
            flat = [
                torch.cat([seqs[members[m]][j][done[m] : done[m] + cuts[m][step]] for m in live])
                for j in range(5)
            ]
            y = gated_delta_rule_rows(
                *flat, pool, torch.tensor([slots[m] for m in live]), q_lens, [ctx[m] + done[m] for m in live]
            )
            for m, piece in zip(live, y.split(q_lens), strict=True):
                outs[m].append(piece)
                done[m] += piece.shape[0]
        return [torch.cat(o) for o in outs], pool

    (one_shot,), pool_one = run([2], [[100]], [1], [0])
    for cut in ([16] * 6 + [4], [1] * 100, [7, 50, 43]):
        (chunked,), pool_cut = run([2], [cut], [1], [0])
        assert torch.equal(chunked, one_shot) and torch.equal(pool_cut[1], pool_one[1])
    mixed, pool_mixed = run([0, 2, 1, 3], [[37], [13, 87], [1], [2, 3]], [0, 1, 2, 4], [0, 0, 4, 2])
    assert torch.equal(mixed[1], one_shot) and torch.equal(pool_mixed[1], pool_one[1])
    (decode,), pool_decode = run([1], [[1]], [2], [4])
    assert torch.equal(mixed[2], decode) and torch.equal(pool_mixed[2], pool_decode[2])

    q, k, v, g, beta = (x[None] for x in seqs[2])
    recurrent = torch_recurrent_gated_delta_rule
    if per_channel:  # transformers' KDA form reads one key head per value head
        q, k = (x.repeat_interleave(HV // HK, dim=-2) for x in (q, k))
        recurrent = recurrent_kimi_delta_attention
    ref, state = recurrent(
        q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(one_shot, ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool_one[1], state[0], rtol=1e-5, atol=1e-6)


def test_one_prompt_among_decode_and_padding_rows_reads_its_own_rows():
    """A call with one prompt (the routed path's call per sequence, here beside a decode row and a padding row
    of slot -1) takes the prompt's rows as they lie: the reference's output and state, the padding row zeros and
    its slot untouched."""
    decode, prompt, pad = _inputs(1, seed=11), _inputs(13, seed=12), _inputs(1, seed=13)
    flat = [torch.cat(parts) for parts in zip(decode, prompt, pad, strict=True)]
    pool = torch.randn(4, HV, DK, DV)
    before = pool.clone()
    out = gated_delta_rule_varlen(*flat, pool, torch.tensor([1, 3, -1]), [1, 13, 1], [5, 0, 0], 4)
    ref_out, ref_state = _reference(prompt, torch.zeros(HV, DK, DV))
    torch.testing.assert_close(out[1:14], ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[3], ref_state, rtol=1e-4, atol=1e-5)
    dec_out, dec_state = _reference(decode, before[1])
    torch.testing.assert_close(out[:1], dec_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[1], dec_state, rtol=1e-4, atol=1e-5)
    assert float(out[14].abs().max()) == 0.0 and torch.equal(pool[[0, 2]], before[[0, 2]])
