"""The sink families' full-attention layers on CUDA (tiny Flint and MiMo checkpoints, bf16), whose decode rows take
the split-context kernel (``dgpp.nn.paged_sink_attention``): with contexts past one 64-token partition, greedy
output keeps the exactness rules (a mixed batch == alone, a prefix hit == cold, chunked == one shot under
``batch_invariant``) and a speculative verify's rows are the bits of the plain decode rows of their positions.
The kernels themselves are checked under the interpreter in tests/kernels/test_sink_split_decode.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.offline import make_pools
from dgpp.policy import overriding
from dgpp.step.model import Model
from dgpp.testing import conformance as conf

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (TRITON_INTERPRET=0)")


def sink_model(kind: str, out: Path, device: str) -> Model:
    from dgpp.startup.loading import load_model
    from dgpp.testing.builders import build_tiny_checkpoint

    if kind == "flint" and not hasattr(
        transformers, "FlintConfig"
    ):  # GPU images may ship an older transformers
        pytest.skip(
            "the tiny Flint checkpoint is written by transformers' FlintConfig (transformers >= 5.24)"
        )
    return load_model(build_tiny_checkpoint(kind, out, dtype=torch.bfloat16, seed=41), device=device)


def check_greedy_exactness(model: Model) -> None:
    prompts = conf.make_prompts(model.info.vocab_size, (70, 150, 9), seed=42)
    conf.check_mixed_batch(model, prompts, max_new_tokens=8, chunk_size=32)
    conf.check_prefix_hit(model, prompts[1], shared_blocks=4)
    with overriding(batch_invariant=True):
        conf.check_chunked_prefill(model, prompts, chunk_sizes=(1, 33), max_new_tokens=8)


@torch.inference_mode()
def check_verify_rows(model: Model, drafts: int = 3) -> None:
    """Sequence A decodes ``drafts + 1`` tokens one step each; sequence B, after the same prefill, takes them in
    one verify step: its rows' logits must be A's, bit for bit."""
    prompt, fed = conf.make_prompts(model.info.vocab_size, (130, drafts + 1), seed=43)
    total = len(prompt) + len(fed)
    pools, blocks, slots = make_pools(model, [total, total], 16)
    runner = ModelRunner(model, pools)
    a_slot, a_table = slots.allocate(), blocks.allocate(blocks.blocks_for_tokens(total))
    b_slot, b_table = slots.allocate(), blocks.allocate(blocks.blocks_for_tokens(total))
    runner.step([SeqWork(a_slot, a_table, 0, prompt, want_logits=False)])
    plain = torch.cat(
        [runner.step([SeqWork(a_slot, a_table, len(prompt) + j, [t])]) for j, t in enumerate(fed)]
    )
    runner.step([SeqWork(b_slot, b_table, 0, prompt, want_logits=False)])
    verify = runner.step([SeqWork(b_slot, b_table, len(prompt), fed, every_row_logits=True)], verify=True)
    assert verify.shape == plain.shape
    assert torch.equal(verify, plain), float((verify - plain).abs().max())


@needs_cuda
@pytest.mark.parametrize("kind", ["flint", "mimo"])
def test_sink_full_layers_keep_greedy_exact_on_cuda(kind: str, tmp_path: Path) -> None:
    check_greedy_exactness(sink_model(kind, tmp_path / kind, "cuda"))


@needs_cuda
@pytest.mark.parametrize("kind", ["flint", "mimo"])
def test_sink_full_layers_verify_rows_are_decode_rows_on_cuda(kind: str, tmp_path: Path) -> None:
    check_verify_rows(sink_model(kind, tmp_path / kind, "cuda"))
