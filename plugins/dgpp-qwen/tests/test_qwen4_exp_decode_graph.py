"""qwen4_exp's decode step in the form a CUDA graph replays (fp32 tiny checkpoint; compress_ratio 4, block_topk 4, so
rows past 19 tokens run sparse):

- along the CUDA path on the CPU (Triton's interpreter, every ``is_cuda`` answered yes as inside the capture), the
  padded decode step reads no device value on the host and sizes nothing by values (``dgpp.bench.launches``
  counts ``sync:*``), in any layer or outside them; the masked torch form of QSA does, and the count sees it;
- the decode graphs' padded static inputs (3 rows in the size-4 batch) give the eager step's logits bit for bit;
- on a CUDA GPU, the decode steps are captured and replayed, against the eager steps.
"""

from __future__ import annotations

import os

import pytest
import torch

from dgpp.engine.graphs import DecodeGraphs
from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.testing.prefilled import prefill_random, restore, snapshot

PROMPTS = (23, 9, 14)  # sparse, dense and dense rows; 9 and 14 cross the dense limit (19) within a few steps
BLOCKS_PER_SEQ = 4  # 64 tokens of 16-token blocks
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the CUDA path's kernels run in Triton's interpreter"
)


@pytest.fixture(scope="module")
def model():
    from dgpp.bench.launches import tiny_model

    return tiny_model("qwen4_exp", torch.float32)


def _prefilled(model, device: str = "cpu"):
    return prefill_random(model, PROMPTS, BLOCKS_PER_SEQ, 16, seed=3, device=device, first_token=1)


@interpreted
def test_the_padded_decode_step_reads_no_device_value_on_the_host(model) -> None:
    from dgpp.bench.launches import count_step

    assert model.decode_graph_safe
    pools, tables, last, _ = _prefilled(model)
    graphs = DecodeGraphs(model, pools, max_batch=4, max_blocks=BLOCKS_PER_SEQ, capture=False)
    for step in range(2):
        work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
        batch = build_batch(work, pools)
        out: list[torch.Tensor] = []
        found = count_step(model, lambda b=batch, o=out: o.append(graphs.run(b)))
        for layer, kind in zip(found.layers, found.layer_kinds, strict=True):
            assert layer, f"nothing was counted in {kind}"
            syncs = sorted(name for name in layer if name.startswith("sync:"))
            assert not syncs, f"decode step {step}, {kind}: {syncs}"
            if "QSAttention" in kind:  # the selection ran on the device
                assert layer["top_k_rows"] == 1 and layer["decode_partition"] == 1, dict(layer)
        assert not [name for name in found.outside if name.startswith("sync:")], dict(found.outside)
        last = torch.argmax(out[0], -1).tolist()


@interpreted
def test_the_masked_torch_form_reads_the_host_and_is_caught(model, monkeypatch) -> None:
    """The check above can fail: QSA's masked torch form (``DGPP_KERNELS=torch``) sizes masks by host lengths."""
    from dgpp.bench.launches import count_step
    from dgpp_qwen.layers import qsa

    monkeypatch.setattr(qsa, "takes_row_path", lambda x: False)
    pools, tables, last, runner = _prefilled(model)
    work = [SeqWork(i, tables[i], n, [last[i]]) for i, n in enumerate(PROMPTS)]
    found = count_step(model, lambda: runner.step(work))
    qsa_layers = [
        layer for layer, kind in zip(found.layers, found.layer_kinds, strict=True) if "QSAttention" in kind
    ]
    assert qsa_layers and all(any(n.startswith("sync:") for n in layer) for layer in qsa_layers)


@interpreted
def test_padded_graph_inputs_give_the_eager_logits_bit_for_bit(model) -> None:
    from dgpp.bench.launches import cuda_path

    pools, tables, last, runner = _prefilled(model)
    graphs = DecodeGraphs(model, pools, max_batch=4, max_blocks=BLOCKS_PER_SEQ, capture=False)
    for step in range(6):  # the 14-token row passes the dense limit within these steps
        work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
        saved = snapshot(pools)
        with cuda_path():
            padded = graphs.run(build_batch(work, pools))  # 3 rows in the size-4 batch: one padding row
            restore(saved)
            eager = runner.step(work)
        assert torch.equal(padded, eager), step
        last = torch.argmax(eager, -1).tolist()
    assert graphs.state_slots[3:].eq(-1).all() and graphs.slot_mapping[3:].eq(-1).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with TRITON_INTERPRET=0)")
def test_decode_steps_are_captured_and_replayed_on_cuda(tmp_path) -> None:
    from dgpp.catalog import tiny_checkpoint
    from dgpp.config_schema import EngineConfig
    from dgpp.startup.loading import load_model

    path = tiny_checkpoint("qwen4_exp").build(tmp_path, seed=0, dtype=torch.float32)
    model = load_model(path, EngineConfig(), dtype=torch.float32, device="cuda")
    assert model.decode_graph_safe
    pools, tables, last, runner = _prefilled(model, "cuda")
    graphs = DecodeGraphs(model, pools, max_batch=4, max_blocks=BLOCKS_PER_SEQ, capture=True)
    graphs.capture()
    assert graphs.use_graphs and set(graphs.graphs) == {1, 2, 4}
    for step in range(8):  # the 9- and 14-token rows pass the dense limit (19) within these steps
        work = [SeqWork(i, tables[i], n + step, [last[i]]) for i, n in enumerate(PROMPTS)]
        saved = snapshot(pools)
        replayed = graphs.run(build_batch(work, pools, "cuda"))
        restore(saved)
        eager = runner.step(work)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)
        assert torch.argmax(replayed, -1).tolist() == torch.argmax(eager, -1).tolist()
        last = torch.argmax(eager, -1).tolist()
