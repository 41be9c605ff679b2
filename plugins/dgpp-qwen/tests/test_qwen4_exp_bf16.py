"""qwen4_exp in bf16 (the release dtype) vs transformers in bf16: the rounding points (GR mix, indexer pooling,
PLE gate, zero-centred norms) follow the reference, so logits stay within bf16 noise and greedy decoding
follows transformers' path with no near-tie flips on this fixture."""

from __future__ import annotations

import torch

from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

BF16_RTOL = 2e-2


def test_bf16_logits_and_greedy_follow_transformers(tmp_path):
    path = build_tiny_qwen4_exp(tmp_path, dtype=torch.bfloat16, seed=41)
    model, reference = load_model(path), load_reference(path)
    assert model.info.dtype == torch.bfloat16
    prompts = conf.make_prompts(model.info.vocab_size, (9, 45), seed=42)
    assert conf.check_logits(model, reference, prompts, rtol=BF16_RTOL) <= BF16_RTOL
    assert conf.check_greedy_near_ties(model, reference, prompts, 32, rtol=BF16_RTOL) == 0
