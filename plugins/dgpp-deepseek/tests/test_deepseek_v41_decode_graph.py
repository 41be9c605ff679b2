"""DeepSeek-V4.1-Flash's decode step in the form a CUDA graph replays, on the CPU (Triton interpreter, fp32 tiny
fixture: window-only, ratio-2 and ratio-1 layers, candidates, Engram):

- along the CUDA path (every ``is_cuda`` answered yes, as inside the capture), the decode steps read no device
  value on the host and size nothing by values (``dgpp.bench.launches`` counts ``sync:*``: ``.item()``,
  ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing, ...) and build no tensor from host data (``sync:tensor``,
  a host-to-device copy that a graph capture refuses) from the forward's start to the logits;
  Engram's rows are gathered before the forward (``Model.stage_decode``), where host reads are allowed;
- the decode graphs' padded static inputs (rows padded to a captured size) give the eager step's logits bit for
  bit, Engram's staged rows included.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_deepseek_v41 import build_fp32_fixture

from dgpp.engine.graphs import DecodeGraphs
from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.kernels._triton import HAS_TRITON
from dgpp.plugin_api import load_model
from dgpp.testing.prefilled import prefill_random, restore, snapshot
from dgpp_deepseek.v41_attention import DeepseekV41Attention
from dgpp_deepseek.v41_engram import EngramV41

pytestmark = pytest.mark.skipif(
    not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the fused decode kernels run in Triton's interpreter (TRITON_INTERPRET=1)",
)

PROMPTS = (23, 9, 14)  # every ratio's groups open and closed within the decoded steps
BLOCKS_PER_SEQ = 4  # 64 tokens of 16-token blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(build_fp32_fixture(tmp_path_factory.mktemp("deepseek_v41_graph")))


def _fused(model, on: bool | None) -> None:
    for module in model.modules():
        if isinstance(module, DeepseekV41Attention):
            module.fused_decode = on


def _prefilled(model):
    return prefill_random(model, PROMPTS, BLOCKS_PER_SEQ, 16, seed=3)


def test_the_decode_step_reads_no_device_value_on_the_host(model) -> None:
    from dgpp.bench.launches import count_step

    assert model.decode_graph_safe
    staged: list[int] = []
    stage = model.stage_decode

    def counted_stage(batch):
        staged.append(batch.input_ids.shape[0])
        stage(batch)

    model.stage_decode = counted_stage
    try:
        pools, tables, last, _ = _prefilled(model)
        graphs = DecodeGraphs(model, pools, max_batch=4, max_blocks=BLOCKS_PER_SEQ, capture=False)
        for step in range(2):  # the ratio-2 rows close their group in one step, buffer their row in the other
            work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
            batch = build_batch(work, pools)
            out: list[torch.Tensor] = []
            found = count_step(model, lambda b=batch, o=out: o.append(graphs.run(b)))
            launches = [c for layer in found.layers for c in layer] + list(found.outside)
            assert launches, "nothing was counted"
            syncs = sorted({name for name in launches if name.startswith("sync:")})
            assert not syncs, f"decode step {step} reads device values on the host: {syncs}"
            last = torch.argmax(out[0], -1).tolist()
    finally:
        del model.stage_decode
    assert staged == [4] * 2  # Engram's rows were staged before every padded step


def test_a_host_read_in_the_step_is_caught(model, monkeypatch) -> None:
    """The check above can fail: the per-sequence forms (``batched_decode`` off) read lengths on the host."""
    from dgpp.bench.launches import count_step

    for module in model.modules():
        if isinstance(module, EngramV41):
            monkeypatch.setattr(module, "batched_decode", False)
    assert not model.decode_graph_safe
    pools, tables, last, runner = _prefilled(model)
    work = [SeqWork(i, tables[i], n, [last[i]]) for i, n in enumerate(PROMPTS)]
    found = count_step(model, lambda: runner.step(work))
    assert any(name.startswith("sync:") for layer in found.layers for name in layer)


@pytest.mark.parametrize("sizes", [[4], [8]])
def test_padded_graph_inputs_give_the_eager_logits_bit_for_bit(model, sizes) -> None:
    """3 rows padded to 4 or to 8 (rows of state slot -1, ``seq_len`` 0, tables of -1, as ``DecodeGraphs`` pads):
    the live rows' logits equal the unpadded eager step's, for steps that close ratio-2 groups and not."""
    _fused(model, True)
    try:
        pools, tables, last, runner = _prefilled(model)
        graphs = DecodeGraphs(model, pools, max_batch=sizes[-1], max_blocks=BLOCKS_PER_SEQ, capture=False)
        graphs.sizes = sizes
        for step in range(4):
            work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
            saved = snapshot(pools)
            padded = graphs.run(build_batch(work, pools))
            after_padded = snapshot(pools)
            restore(saved)
            eager = runner.step(work)
            assert torch.equal(padded, eager)
            # the padding rows wrote nothing: the caches end the same either way
            for live, copy in after_padded:
                assert torch.equal(live, copy)
            last = torch.argmax(eager, -1).tolist()
        assert graphs.stats.padded_rows == 4 * (sizes[0] - len(PROMPTS))
    finally:
        _fused(model, None)
