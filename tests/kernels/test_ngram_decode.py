"""The n-gram embedding's decode kernels (interpreter, fp32) against their torch references, and the references
against the per-sequence PLE layer they stand in for on the CUDA decode path."""

from __future__ import annotations

import torch

from dgpp.kernels.ngram_decode import (
    NgramInjectInputs,
    NgramRowsInputs,
    ngram_inject_ref,
    ngram_inject_triton,
    ngram_rows_ref,
    ngram_rows_triton,
    write_live_rows,
)
from dgpp_qwen.layers.ngram import NGramHasher, shifted_in_segment
from dgpp_qwen.qwen4_exp_config import NGramConfig

EOS, NGRAM, PER_ORDER = 9, 4, 3
STREAMS, HIDDEN, TAPS = 4, 24, 3


def _hasher() -> NGramHasher:
    cfg = NGramConfig(
        layer_ids=(0,),
        vocab_size_base=1000,
        embed_dim=NGRAM - 1,
        conv_kernel=TAPS,
        ngram_size=NGRAM,
        heads_per_ngram=PER_ORDER,
        seed=7,
        eos_token_id=EOS,
        vocab_divisor=1,
        split_parts=1,
    )
    return NGramHasher(cfg, vocab_size=64, ple_index=1)


def _rows_step(hasher: NGramHasher) -> NgramRowsInputs:
    # slot 2: EOS one back; slot 0: EOS two back; slot 3 fresh (context_len 0); last row padding (slot -1)
    context = torch.tensor([[5, EOS, 7], [40, 41, 42], [11, 12, EOS], [1, 2, 3]])
    return NgramRowsInputs(
        tokens=torch.tensor([13, 30, 31, 17, 0]),
        context=context,
        slots=torch.tensor([2, 0, 1, 3, -1], dtype=torch.int32),
        fresh=torch.tensor([0, 0, 0, 1, 1], dtype=torch.int8),
        multipliers=hasher.multipliers,
        sizes=hasher.sizes,
        offsets=hasher.offsets,
        heads_per_order=PER_ORDER,
        eos=EOS,
    )


def _expected_rows(hasher: NGramHasher, step: NgramRowsInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each live row through the per-sequence hasher, and the context it leaves."""
    rows, context = [], step.context.clone()
    for token, slot, starts in zip(step.tokens, step.slots, step.fresh, strict=True):
        fresh = bool(starts) or int(slot) < 0
        previous = torch.full((NGRAM - 1,), EOS) if fresh else step.context[int(slot)]
        history = torch.cat([previous, token[None]])
        rows.append(hasher(history, 1))
        if int(slot) >= 0:
            context[int(slot)] = history[1:]
    return torch.cat(rows), context


def test_row_ids_equal_the_per_sequence_hasher() -> None:
    hasher = _hasher()
    assert shifted_in_segment(torch.tensor([1, EOS, 2, 3]), 2, EOS)[-1] == EOS  # the rule the cases exercise
    step = _rows_step(hasher)
    expected, context_after = _expected_rows(hasher, step)
    for fn in (ngram_rows_ref, ngram_rows_triton):
        run = step._replace(context=step.context.clone())
        assert torch.equal(fn(run), expected), fn.__name__
        assert torch.equal(run.context, context_after), fn.__name__  # the padding row stored nothing


def test_write_live_rows_skips_padding_rows_even_on_a_shared_slot() -> None:
    state = torch.zeros(3, 2)
    write_live_rows(state, torch.tensor([0, -1, 2, -1]), torch.tensor([[1.0, 1], [5, 5], [2, 2], [6, 6]]))
    assert torch.equal(state, torch.tensor([[1.0, 1], [0, 0], [2, 2]]))
    write_live_rows(state, torch.tensor([-1, -1]), torch.ones(2, 2))  # no live row: nothing changes
    assert torch.equal(state, torch.tensor([[1.0, 1], [0, 0], [2, 2]]))


def _inject_step(seed: int) -> NgramInjectInputs:
    g = torch.Generator().manual_seed(seed)
    width, rows = STREAMS * HIDDEN, 4
    history = (TAPS - 1) * NGRAM  # the PLE conv is dilated by the n-gram size
    return NgramInjectInputs(
        hyper=torch.randn(rows, width, generator=g),
        key=torch.randn(rows, width, generator=g),
        value=torch.randn(rows, HIDDEN, generator=g),
        norm_weights=tuple(torch.randn(width, generator=g) * 0.3 for _ in range(3)),  # type: ignore[arg-type]
        conv_weight=torch.randn(width, TAPS, generator=g),
        conv_state=torch.randn(3, history, width, generator=g),
        slots=torch.tensor([1, 0, 2, -1], dtype=torch.int32),
        fresh=torch.tensor([False, True, False, True]),  # row 1 starts its sequence, row 3 padding
        streams=STREAMS,
        dilation=NGRAM,
        eps=1e-6,
    )


def test_inject_matches_reference_and_updates_only_live_histories() -> None:
    step = _inject_step(1)
    ours = step._replace(conv_state=step.conv_state.clone())
    theirs = step._replace(conv_state=step.conv_state.clone())
    out, ref = ngram_inject_triton(ours), ngram_inject_ref(theirs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.conv_state, theirs.conv_state, rtol=1e-5, atol=1e-5)
    assert torch.equal(
        ours.conv_state[0, :-1], torch.zeros_like(ours.conv_state[0, :-1])
    )  # fresh: zeros shift in
    assert torch.equal(ours.conv_state[1, :-1], step.conv_state[1, 1:])  # the history moved one row
    # the gate counts per stream: another key norm weight for stream 2 moves stream 2 only
    weights = list(step.norm_weights)
    weights[0] = weights[0].clone().index_fill_(0, torch.arange(2 * HIDDEN, 3 * HIDDEN), 2.0)
    moved = ngram_inject_triton(
        step._replace(norm_weights=tuple(weights), conv_state=step.conv_state.clone())
    )
    diff = (moved - out).unflatten(-1, (STREAMS, HIDDEN)).abs().amax(dim=(0, 2))
    assert diff[2] > 1e-3 and torch.all(diff[[0, 1, 3]] == 0)


def test_inject_reference_equals_the_ple_layer() -> None:
    from dgpp.plugin_api import ForwardBatch
    from dgpp_qwen.layers.ngram import PLELayer

    step = _inject_step(2)
    hasher = _hasher()
    layer = PLELayer(
        hasher.cfg,
        "ple",
        1,
        vocab_size=64,
        hidden_size=HIDDEN,
        hc_count=STREAMS,
        eps=1e-6,
        dtype=torch.float32,
    )
    layer.norm_key.weight.data.copy_(step.norm_weights[0])
    layer.norm_query.weight.data.copy_(step.norm_weights[1])
    layer.norm_conv.weight.data.copy_(step.norm_weights[2])
    layer.conv1d.weight.data.copy_(step.conv_weight[:, None, :])
    # the projections' outputs are the step's key and value; the table is not read
    layer.key_proj.forward = lambda _e: step.key  # type: ignore[method-assign]
    layer.value_proj.forward = lambda _e: step.value  # type: ignore[method-assign]
    layer.ple_embedding.forward = lambda rows: torch.zeros(rows.shape[0], 1)  # type: ignore[method-assign]
    rows = step.hyper.shape[0]
    context_lens = torch.where(step.fresh, 0, 6).to(torch.int32)

    class _Cache:
        state = {
            "ple": {
                "ngram_context": torch.zeros(3, NGRAM - 1, dtype=torch.int64),
                "conv": step.conv_state.clone(),
            }
        }

    batch = ForwardBatch(
        input_ids=torch.zeros(rows, dtype=torch.int64),
        positions=torch.zeros(rows, dtype=torch.int64),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=context_lens + 1,
        context_lens=context_lens,
        block_tables=torch.zeros(rows, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64),
        state_slots=step.slots,
        logits_indices=torch.arange(rows),
        cache=_Cache(),  # type: ignore[arg-type]
        q_lens_cpu=[1] * rows,
        seq_lens_cpu=(context_lens + 1).tolist(),
        context_lens_cpu=context_lens.tolist(),
    )
    expected = layer(step.hyper, batch)
    ours = step._replace(conv_state=step.conv_state.clone())
    # close, not equal: the layer takes its sigmoids row by row (CPU vector tails), the reference all rows at once
    torch.testing.assert_close(ngram_inject_ref(ours), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.conv_state, _Cache.state["ple"]["conv"], rtol=1e-6, atol=1e-6)
