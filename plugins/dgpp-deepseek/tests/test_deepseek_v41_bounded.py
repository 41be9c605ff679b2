"""DeepSeek-V4.1's bounded prefill (``engine.prefill_mode: bounded``): the encoder layers over every prompt row, the
decoder layers over the last window (6 rows on the fixture) only. It is lossy past the window and exact within
it, and its last row matches the float64 reference's bounded walk; chunked prefill (cuts 1, 3, 7), a prefix-cache
snapshot and mixed batches give the one-shot bounded tokens, since each request keeps its last window of encoder
output as state."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from deepseek_v41_reference import load_reference
from test_deepseek_v41 import build_fp32_fixture

from dgpp.errors import ConfigError
from dgpp.offline import greedy_generate
from dgpp.plugin_api import EngineConfig
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_deepseek.v41_model import DeepseekV41ForCausalLM

BOUNDED = EngineConfig(prefill_mode="bounded")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_fp32_fixture(tmp_path_factory.mktemp("deepseek_v41_bounded"))


@pytest.fixture(scope="module")
def models(checkpoint):
    return load_model(checkpoint), load_model(checkpoint, BOUNDED)


def _last_row(model, prompt: list[int]) -> torch.Tensor:
    """The prompt's last-row logits through a one-shot prefill (the row a bounded prefill computes)."""
    return conf.engine_forced_logits(model, prompt, [0])[0]


def test_bounded_matches_the_reference_bounded_prefill(checkpoint, models):
    """The last row of a one-shot bounded prefill against the float64 reference's bounded walk, within 1e-4."""
    _, bounded = models
    reference = load_reference(checkpoint)
    for prompt in conf.make_prompts(bounded.info.vocab_size, (5, 7, 23, 40), seed=1):
        ref = reference.new_session().extend(prompt, bounded=True)[-1].float()
        assert float((_last_row(bounded, prompt) - ref).abs().max() / ref.abs().max()) < 1e-4, len(prompt)


def test_within_the_window_bounded_is_exact(models):
    exact, bounded = models
    prompt = conf.make_prompts(exact.info.vocab_size, (6,), seed=1)[0]
    assert torch.equal(_last_row(bounded, prompt), _last_row(exact, prompt))
    assert greedy_generate(bounded, [prompt], 12) == greedy_generate(exact, [prompt], 12)


def test_past_the_window_bounded_moves_the_logits(models):
    exact, bounded = models
    for prompt in conf.make_prompts(exact.info.vocab_size, (23, 40), seed=1):
        ours, ref = _last_row(bounded, prompt), _last_row(exact, prompt)
        assert float((ours - ref).abs().max() / ref.abs().max()) > 1e-3  # lossy: a named engine key


def test_bounded_chunked_snapshot_and_mixed_equal_one_shot(models):
    _, bounded = models
    prompts = conf.make_prompts(bounded.info.vocab_size, (5, 23, 40), seed=1)
    one_shot = greedy_generate(bounded, prompts, 8)
    for chunk in (1, 3, 7):
        assert greedy_generate(bounded, prompts, 8, chunk_size=chunk) == one_shot, chunk
    conf.check_state_snapshot(bounded, prompts[2], split=19)
    conf.check_mixed_batch(bounded, prompts, max_new_tokens=8)


def test_bounded_needs_a_ratio_1_decoder_without_engram(models):
    exact, _ = models
    cfg = exact.config
    for change in ({"engram_layer_ids": (1, 7)}, {"compress_ratios": (*cfg.compress_ratios[:7], 2, 2, 2)}):
        bad = dataclasses.replace(cfg, **change)
        with pytest.raises(ConfigError, match="prefill_mode 'bounded'"):
            DeepseekV41ForCausalLM(bad, dtype=torch.float32, bounded=True)
