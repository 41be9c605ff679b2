"""Models with an MTP drafter keep every row's hidden (``last_hidden``) only when the speculative decoder asks
(``Model.keep_hidden``, set by ``SpeculativeDecoder``): plain serving holds no extra activations, and keeping
them changes no logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import SpeculativeDecoder
from dgpp.engine.work import SeqWork
from dgpp.startup.loading import load_model
from dgpp.step.pools import CachePools


class NoCacheDrafter(nn.Module):
    """Enough of a drafter for the decoder's constructor (no cache entries)."""

    def cache_spec(self) -> dict:
        return {}

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return hidden


def _build(family: str, path):
    if family == "glm":
        from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

        return build_tiny_glm4_moe(path, seed=4)
    if family == "qwen4_exp":
        from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

        return build_tiny_qwen4_exp(path, seed=4)
    from dgpp.testing.builders import build_tiny_checkpoint

    return build_tiny_checkpoint(family, path, seed=4)


@pytest.mark.parametrize("family", ["glm", "qwen3_5", "qwen4_exp"])
def test_last_hidden_only_with_a_drafter(family: str, tmp_path) -> None:
    model = load_model(_build(family, tmp_path))
    assert model.keep_hidden is False
    pools = CachePools(model.cache_spec(), 16, 4, 2)
    runner = ModelRunner(model, pools)
    prompt = [5, 9, 11, 3, 7, 2, 8]

    def prefill() -> torch.Tensor:
        pools.zero_state(0)
        return runner.step([SeqWork(0, [0, 1], 0, prompt)])

    plain = prefill()
    assert model.last_hidden is None  # nothing of the step outlives it
    SpeculativeDecoder(runner, NoCacheDrafter(), depth=1)
    assert model.keep_hidden is True
    kept = prefill()
    assert model.last_hidden is not None and model.last_hidden.shape[0] == len(prompt)
    assert torch.equal(plain, kept)
