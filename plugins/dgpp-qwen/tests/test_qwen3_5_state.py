"""Qwen3.5 hybrid per-request state: chunked prefill ≡ one-shot (logits and tokens), mixed prefill/decode
batches ≡ each sequence alone, and state snapshots (``pools.copy_state``) that reproduce a continuation."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.offline import make_pools
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The dense hybrid: state handling is the same for the MoE variant (only the MLP differs)."""
    return load_model(build_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5"), seed=3))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return load_model(build_tiny_checkpoint("qwen3_5_moe", tmp_path_factory.mktemp("qwen3_5_moe"), seed=3))


@torch.inference_mode()
def _prefill_logits(model, prompt: list[int], chunk: int | None) -> tuple[torch.Tensor, dict]:
    """Last-row logits after prefilling ``prompt`` in ``chunk``-token pieces, and the final state of every layer."""
    pools, blocks, slots = make_pools(model, [len(prompt)], 16)
    runner = ModelRunner(model, pools)
    table, slot = blocks.allocate(blocks.blocks_for_tokens(len(prompt))), slots.allocate()
    step = chunk or len(prompt)
    for start in range(0, len(prompt), step):
        logits = runner.step([SeqWork(slot, table, start, prompt[start : start + step])])
    states = {name: {t: v[slot].clone() for t, v in ts.items()} for name, ts in pools.state.items()}
    return logits[0], states


def test_chunked_prefill_logits_and_state_equal_one_shot(model):
    prompt = conf.make_prompts(model.info.vocab_size, (90,), seed=4)[0]
    one_logits, one_state = _prefill_logits(model, prompt, None)
    for chunk in (1, 7, 32, 64):
        logits, state = _prefill_logits(model, prompt, chunk)
        torch.testing.assert_close(logits, one_logits, rtol=1e-5, atol=1e-5, msg=f"chunk {chunk}")
        for name in one_state:
            for t in one_state[name]:
                torch.testing.assert_close(
                    state[name][t], one_state[name][t], rtol=1e-5, atol=1e-5, msg=f"chunk {chunk}: {name}.{t}"
                )


def test_chunked_prefill_greedy_equals_one_shot(model):
    prompts = conf.make_prompts(model.info.vocab_size, (11, 70), seed=5)
    conf.check_chunked_prefill(model, prompts, chunk_sizes=(1, 5, 16, 64), max_new_tokens=12)


@pytest.mark.parametrize("which", ("model", "moe_model"))
def test_mixed_prefill_decode_batch_equals_each_alone(which, request):
    model = request.getfixturevalue(which)
    conf.check_mixed_batch(
        model, conf.make_prompts(model.info.vocab_size, (3, 17, 40, 9), seed=6), max_new_tokens=10
    )


def test_state_snapshot_restore_reproduces_continuation(model):
    conf.check_state_snapshot(model, conf.make_prompts(model.info.vocab_size, (30,), seed=7)[0], split=16)


@torch.inference_mode()
def test_snapshot_restored_into_another_slot_continues_a_shared_prefix(model):
    """Prefix-cache use: sequence B reuses A's prompt blocks and a snapshot of A's state taken at the prompt
    end, restored into B's own slot after A has moved on; B's greedy tokens equal A's."""
    prompt = conf.make_prompts(model.info.vocab_size, (32,), seed=8)[0]  # two full 16-token blocks
    pools, blocks, slots = make_pools(model, [64, 64, 64], 16)
    runner = ModelRunner(model, pools)
    shared = blocks.allocate(2)
    a_slot, snapshot, b_slot = slots.allocate(), slots.allocate(), slots.allocate()

    def continue_greedy(slot: int, table: list[int], first_logits: torch.Tensor, n: int = 10) -> list[int]:
        out, logits = [], first_logits
        for i in range(n):
            out.append(int(torch.argmax(logits[0])))
            logits = runner.step([SeqWork(slot, table, len(prompt) + i, [out[-1]])])
        return out

    logits = runner.step([SeqWork(a_slot, shared, 0, prompt)])
    pools.copy_state(a_slot, snapshot)
    a_tokens = continue_greedy(a_slot, shared + blocks.allocate(1), logits)
    pools.copy_state(snapshot, b_slot)
    assert b_slot != a_slot
    b_tokens = continue_greedy(b_slot, shared + blocks.allocate(1), logits)
    conf.assert_same_tokens(b_tokens, a_tokens, "sequence restored from a snapshot in another slot")


@torch.inference_mode()
def test_decode_padding_rows_write_nothing(model):
    """CUDA-graph batches pad decode steps with rows of state slot -1 / KV slot -1 / seq_len 0: the real rows'
    logits must not change and no pool entry (state or K/V) may be written by a padding row."""
    from dgpp.engine.runner import build_batch

    prompts = conf.make_prompts(model.info.vocab_size, (6, 11), seed=9)
    pools, blocks, slots = make_pools(model, [16, 16, 16], 16)
    runner = ModelRunner(model, pools)
    tables = [blocks.allocate(1) for _ in prompts]
    seq_slots = [slots.allocate() for _ in prompts]
    spare = slots.allocate()  # never used: a padding row must not touch it (slot -1 would wrap to it)
    firsts = (
        runner.step([SeqWork(s, t, 0, p) for s, t, p in zip(seq_slots, tables, prompts, strict=False)])
        .argmax(-1)
        .tolist()
    )
    work = [
        SeqWork(s, t, len(p), [tok]) for s, t, p, tok in zip(seq_slots, tables, prompts, firsts, strict=False)
    ]
    snapshot = {n: {t: v.clone() for t, v in ts.items()} for n, ts in pools.state.items()}
    kv_before = {n: (k.clone(), v.clone()) for n, (k, v) in pools.kv.items()}
    plain = model.compute_logits(model(build_batch(work, pools)))
    after_plain = {n: {t: v.clone() for t, v in ts.items()} for n, ts in pools.state.items()}
    for name, ts in snapshot.items():  # rewind the state, then run the same step padded with two rows
        for t, v in ts.items():
            pools.state[name][t].copy_(v)
    batch = build_batch(work + [SeqWork(0, [0], 0, [0]), SeqWork(0, [0], 0, [0])], pools)
    batch.state_slots[2:] = -1
    batch.slot_mapping[2:] = -1
    batch.seq_lens[2:] = 0
    batch.seq_lens_cpu[2:] = [0, 0]
    batch.logits_indices = batch.logits_indices[:2]
    padded = model.compute_logits(model(batch))
    torch.testing.assert_close(padded, plain, rtol=1e-5, atol=1e-5)  # a 4-row GEMM rounds unlike a 2-row one
    for name, ts in after_plain.items():
        for t, v in ts.items():
            torch.testing.assert_close(pools.state[name][t], v, rtol=1e-5, atol=1e-5, msg=f"{name}.{t}")
            assert torch.equal(pools.state[name][t][spare], snapshot[name][t][spare]), (
                f"padding wrote {name}.{t}"
            )
    for name, (k, _v) in pools.kv.items():
        written = (k != kv_before[name][0]).any(-1).any(-1).nonzero().tolist()
        assert all(blk in (tables[0][0], tables[1][0]) for blk, _ in written), f"{name}: padding wrote K/V"


@torch.inference_mode()
def test_padded_graph_decode_equals_eager(model):
    """The decode-graph path (run eagerly here: ``capture=False``): each sequence decodes twice, once through the
    padded static batch (3 rows in a size-4 graph: one padding row with state slot -1) and once eagerly from an
    identical copy of its state and K/V; the tokens and logits agree, and no spare slot is touched."""
    from dgpp.engine.graphs import DecodeGraphs
    from dgpp.engine.runner import build_batch

    prompts = conf.make_prompts(model.info.vocab_size, (5, 12, 9), seed=12)
    n, steps = len(prompts), 6
    pools, blocks, slots = make_pools(model, [32] * (2 * n + 1), 16)
    runner = ModelRunner(model, pools)
    graphs = DecodeGraphs(model, pools, max_batch=4, max_blocks=2, capture=False)
    tables = [blocks.allocate(2) for _ in range(2 * n)]
    seq_slots = [slots.allocate() for _ in range(2 * n)]
    spare = slots.allocate()
    spare_state = {name: {t: v[spare].clone() for t, v in ts.items()} for name, ts in pools.state.items()}
    first = runner.step([SeqWork(s, t, 0, p) for s, t, p in zip(seq_slots, tables, prompts * 2, strict=True)])
    tokens = [list(p) + [int(row.argmax())] for p, row in zip(prompts * 2, first, strict=True)]
    for _ in range(steps):
        work = [
            SeqWork(s, t, len(tok) - 1, tok[-1:]) for s, t, tok in zip(seq_slots, tables, tokens, strict=True)
        ]
        eager = runner.step(work[:n])
        padded = graphs.run(build_batch(work[n:], pools))
        torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
        for tok, row in zip(tokens, torch.cat([eager, padded]), strict=True):
            tok.append(int(row.argmax()))
    assert tokens[:n] == tokens[n:]
    for name, ts in spare_state.items():
        for t, v in ts.items():
            assert torch.equal(pools.state[name][t][spare], v), f"a padding row wrote {name}.{t}"
