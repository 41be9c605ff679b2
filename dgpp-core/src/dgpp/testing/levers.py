"""Checks for a lossy lever switched through ``dgpp.policy`` (the prefill levers): it acts, within a bound, and keeps
every row's bits independent of chunking and batching with it on."""

from __future__ import annotations

import torch

from dgpp.offline import engine_all_logits, greedy_generate
from dgpp.policy import overriding
from dgpp.step.model import Model
from dgpp.testing import conformance as conf


def lever_row_errors(model: Model, prompts: list[list[int]], lever: str) -> torch.Tensor:
    """Per row of every prompt: the largest |logit| change the lever (a policy field) makes, relative to the
    lever-off chain's largest |logit|; a row left at zero is a row the lever did not act on."""
    exact = torch.cat(engine_all_logits(model, prompts))
    with overriding(**{lever: True}):
        lossy = torch.cat(engine_all_logits(model, prompts))
    return (lossy - exact).abs().amax(-1) / float(exact.abs().max())


def check_lever_exactness(model: Model, prompts: list[list[int]], lever: str, new_tokens: int = 6) -> None:
    """With the lever on: logits bit-identical chunked (1 and 5 rows) and one-shot, alone and batched; greedy
    tokens identical one-shot, in 3-token chunks and alone."""
    with overriding(**{lever: True}):
        conf.check_chunk_invariance(model, prompts, chunk_sizes=(1, 5))
        conf.check_batch_invariance(model, prompts)
        together = greedy_generate(model, prompts, new_tokens)
        assert together == greedy_generate(model, prompts, new_tokens, chunk_size=3), "chunked greedy differs"
        alone = [greedy_generate(model, [p], new_tokens)[0] for p in prompts]
        assert together == alone, "batched greedy differs from each prompt alone"
