"""GLM-5.3-Flash in bf16 (the release's compute dtype) on a tiny checkpoint: the KDA state stays fp32, conv history
and caches are bf16, and our logits are as close to transformers' fp32 run as transformers' own bf16 run is.
(At these weight scales a bf16 rounding flips a MoE route or a pool pick now and then, and the KDA state carries
the change to later rows on either side, so rows are compared by their typical error, not their worst.)"""

from __future__ import annotations

import torch

from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next


def _row_errors(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (ours - ref).abs().max(-1).values / ref.abs().max()


def test_bf16_rows_as_close_to_fp32_as_transformers_bf16(tmp_path):
    path = build_tiny_glm5_next(tmp_path, seed=9, dtype=torch.bfloat16)
    model = load_model(path)
    assert model.info.dtype == torch.bfloat16
    spec = model.cache_spec()
    assert spec["layers.0.self_attn"].tensors["recurrent"][1] == torch.float32
    assert spec["layers.0.self_attn"].tensors["v_conv"][1] == torch.bfloat16
    assert spec["layers.1.self_attn"].dtype == torch.bfloat16
    ref16, ref32 = load_reference(path), load_reference(path, dtype=torch.float32)
    ours_err, theirs_err = [], []
    for prompt in conf.make_prompts(model.info.vocab_size, (6, 40), seed=10):
        exact = conf.reference_logits(ref32, prompt)
        ours_err.append(_row_errors(conf.engine_all_logits(model, [prompt])[0], exact))
        theirs_err.append(_row_errors(conf.reference_logits(ref16, prompt), exact))
    ours, theirs = torch.cat(ours_err), torch.cat(theirs_err)
    assert float(ours.median()) <= 1.5 * float(theirs.median()) + 5e-3, (ours.median(), theirs.median())
    assert float(ours.median()) < 3e-2
