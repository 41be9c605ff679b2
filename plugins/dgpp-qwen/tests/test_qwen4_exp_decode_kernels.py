"""qwen4_exp decode steps along the CUDA path (Triton kernels run by the interpreter on CPU tensors,
``dgpp.bench.launches.cuda_path``): the same logits as the CPU path within fp32 rounding, the same bits solo and
batched, no host reads in any layer (QSA selects its keys on the device), and fewer launches per layer than the torch
glue took."""

from __future__ import annotations

import os

import pytest
import torch

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.step.pools import CachePools
from dgpp_qwen.testing_qwen4_exp import EOS

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CUDA path's kernels run in Triton's interpreter"
)

BLOCK, BLOCKS_PER_SEQ, STEPS = 16, 4, 3
# decode rows per sequence: one below the QSA dense limit, one above it with an EOS inside (a fresh n-gram segment)
PROMPTS = (
    [(5 * i + 2) % 90 + 3 for i in range(9)],
    [EOS if i == 6 else (7 * i + 3) % 97 + 1 for i in range(24)],
)


@pytest.fixture(scope="module")
def model():
    from dgpp.bench.launches import tiny_model

    return tiny_model("qwen4_exp", torch.float32)


def _decode(model, seqs: list[int], cuda: bool) -> list[torch.Tensor]:
    """Prefill sequences ``seqs`` (CPU path), then ``STEPS`` batched greedy decode steps; each step's logits."""
    from dgpp.bench.launches import cuda_path

    runner = ModelRunner(
        model, CachePools(model.cache_spec(), BLOCKS_PER_SEQ * len(PROMPTS), BLOCK, len(PROMPTS))
    )
    tables = {s: list(range(s * BLOCKS_PER_SEQ, (s + 1) * BLOCKS_PER_SEQ)) for s in seqs}
    prompts = {s: list(PROMPTS[s]) for s in seqs}
    last = {s: int(runner.step([SeqWork(s, tables[s], 0, prompts[s])])[0].argmax()) for s in seqs}
    lengths = {s: len(prompts[s]) for s in seqs}
    steps = []
    for _ in range(STEPS):
        work = [SeqWork(s, tables[s], lengths[s], [last[s]]) for s in seqs]
        if cuda:
            with cuda_path():
                logits = runner.step(work)
        else:
            logits = runner.step(work)
        steps.append(logits)
        for row, s in enumerate(seqs):
            last[s], lengths[s] = int(logits[row].argmax()), lengths[s] + 1
    return steps


def test_cuda_path_decode_matches_the_cpu_path_and_is_batch_invariant(model) -> None:
    cpu, cuda = _decode(model, [0, 1], cuda=False), _decode(model, [0, 1], cuda=True)
    for ours, theirs in zip(cuda, cpu, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5 * float(theirs.abs().max()))
    solo = [_decode(model, [s], cuda=True) for s in (0, 1)]
    for step, logits in enumerate(cuda):
        for row in range(2):
            assert torch.equal(logits[row], solo[row][step][0]), f"step {step}, sequence {row}"


@pytest.mark.parametrize("context", [12, 40])
def test_decode_layers_launch_few_ops_and_read_nothing_on_the_host(model, context) -> None:
    """12 tokens: one 16-token block, too narrow a table for a sparse row (every row dense, no selection); 40: three
    blocks, past the dense limit (19): the device selection runs."""
    from dgpp.bench.launches import count_decode

    found = count_decode(model, context=context)
    for layer, kind in zip(found.layers, found.layer_kinds, strict=True):
        # the last layer also runs the final mixer's
        assert layer["stream_mix"] >= 2 and not any(
            op in layer for op in ("aten.rsqrt", "aten.silu", "aten.pow")
        )
        assert not [op for op in layer if op.startswith("sync:")], dict(layer)
        if "PLELayer" in kind:  # the GDN layers of this fixture carry PLE
            assert layer["ngram_rows"] == 1 and layer["ngram_inject"] == 1
            # 194 launches with the torch glue (bf16 checkpoint), 40 now in bf16 and fp32
            assert sum(layer.values()) <= 40, dict(layer)
        else:  # QSA: 134 with the torch glue and host-read selection (bf16); on the device path (fp32) 95 / 103 in
            # the step's first QSA layer, which also computes the block-key store's indices, 61 / 69 in the next
            assert sum(layer.values()) <= (95 if context == 12 else 103), dict(layer)
            assert layer["write_kv"] == 2 and layer["store_rows"] == 1  # K/V, index keys, block keys
            assert layer["decode_partition"] == 1 and "aten.softmax" not in layer
            selected = ("index_scores", "top_k_rows", "pooled_positions")
            assert all((op in layer) == (context == 40) for op in selected), dict(layer)


def test_verify_rows_on_the_cuda_path_are_the_decode_rows(model) -> None:
    """A speculative verify of three tokens gives each row the bits plain decode gives it, token by token: the first
    layer (PLE + GDN + MoE, whose inputs are the token embeddings alone), and the logits through every layer (QSA
    selects and attends each verify row as its own decode row)."""
    from dgpp.bench.launches import cuda_path

    prompt, table = list(PROMPTS[1]), list(range(BLOCKS_PER_SEQ))
    drafts = [11, EOS, 13]
    first = model.model.layers[0]
    seen: dict[str, list[torch.Tensor]] = {"ple": [], "layer": []}
    hooks = [
        first.ple.register_forward_hook(lambda _m, _a, out: seen["ple"].append(out)),
        first.register_forward_hook(lambda _m, _a, out: seen["layer"].append(out[0])),
    ]

    def prefilled() -> ModelRunner:
        runner = ModelRunner(model, CachePools(model.cache_spec(), BLOCKS_PER_SEQ, BLOCK, 1))
        runner.step([SeqWork(0, table, 0, prompt)])
        for outs in seen.values():
            outs.clear()
        return runner

    try:
        decoding = prefilled()
        with cuda_path():
            logits = [
                decoding.step([SeqWork(0, table, len(prompt) + j, [token])]) for j, token in enumerate(drafts)
            ]
        plain = {name: torch.cat(outs) for name, outs in seen.items()}
        plain["logits"] = torch.cat(logits)
        verifying = prefilled()
        with cuda_path():
            logits = [
                verifying.step([SeqWork(0, table, len(prompt), drafts, every_row_logits=True)], verify=True)
            ]
        verified = {name: torch.cat(outs) for name, outs in seen.items()}
        verified["logits"] = torch.cat(logits)
    finally:
        for hook in hooks:
            hook.remove()
    for name in plain:
        assert torch.equal(verified[name], plain[name]), name


def test_a_decode_row_beside_a_prompt_chunk_keeps_its_bits(model) -> None:
    """On the CUDA path a step mixing one sequence's decode row with another's prompt gives the decode row its
    solo bits (n-gram kernels) and the prompt its own (the torch form, one sequence per call)."""
    from dgpp.bench.launches import cuda_path

    tables = [list(range(BLOCKS_PER_SEQ)), list(range(BLOCKS_PER_SEQ, 2 * BLOCKS_PER_SEQ))]

    def run(works: list[list[SeqWork]]) -> torch.Tensor:
        runner = ModelRunner(model, CachePools(model.cache_spec(), 2 * BLOCKS_PER_SEQ, BLOCK, 2))
        runner.step([SeqWork(0, tables[0], 0, list(PROMPTS[1]))])
        with cuda_path():
            return torch.cat([runner.step(step) for step in works])

    decode = SeqWork(0, tables[0], len(PROMPTS[1]), [EOS])
    prompt = SeqWork(1, tables[1], 0, list(PROMPTS[0]))
    mixed = run([[decode, prompt]])
    alone = run([[decode], [prompt]])
    assert torch.equal(mixed, alone)


def test_decoder_layers_move_nothing_to_the_host(model) -> None:
    """No tensor-to-host call (``.tolist()``, ``.item()``, ``.cpu()``, ``.numpy()``, ``bool/int/float(t)``) runs
    inside a decoder layer (GDN + PLE, QSA past its dense limit) of a CUDA-path decode step (Triton's interpreter, which reads its arguments on the
    host, is left out): none of them can be captured in a CUDA graph, and the dispatch-level count above does not
    see a list conversion."""
    from torch.overrides import TorchFunctionMode

    from dgpp.bench.launches import _Recorder, cuda_path

    host_calls = {
        torch.Tensor.tolist,
        torch.Tensor.item,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
    }
    recorder, inside, seen = _Recorder(), [False], []

    class HostCalls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if inside[0] and not recorder.in_kernel and func in host_calls:
                seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    layers = list(model.model.layers)
    assert {layer.layer_type for layer in layers} == {"linear_attention", "full_attention"}
    hooks = [h for layer in layers for h in _mark(layer, inside)]
    runner = ModelRunner(model, CachePools(model.cache_spec(), BLOCKS_PER_SEQ, BLOCK, 1))
    table = list(range(BLOCKS_PER_SEQ))
    runner.step([SeqWork(0, table, 0, list(PROMPTS[1]))])
    try:
        with cuda_path(recorder), HostCalls():
            runner.step([SeqWork(0, table, len(PROMPTS[1]), [EOS])])
    finally:
        for hook in hooks:
            hook.remove()
    assert not seen, seen


def _mark(layer, inside: list[bool]) -> list:
    def enter(_module, _args) -> None:
        inside[0] = True

    def leave(_module, _args, _out) -> None:
        inside[0] = False

    return [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
