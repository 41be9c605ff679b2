"""The conformance checks a family's fp32 tests run, as pytest classes to subclass (``conformance.py`` holds the
checks themselves).

A test module subclasses ``FamilyConformance`` (or ``HybridConformance``, which adds the state snapshot) in a
class named ``Test...`` (and ``KVFp8Lever`` for ``engine.kv_dtype: fp8``) and provides a fixture ``fp32_pair`` (our model and transformers' for one tiny
checkpoint; ``tiny_checkpoint_fixtures`` makes it). The class attributes set each check's prompts (lengths and
seed) and lengths of run, which a family picks around its own geometry (a sliding window, compression ratios).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dgpp.offline import DEFAULT_LENGTHS, greedy_generate, make_pools
from dgpp.startup.loading import load_model
from dgpp.step.cache_spec import KV_FP8
from dgpp.step.model import Model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference


def tiny_checkpoint_fixtures(build: Callable[..., Path], name: str) -> tuple[Callable, Callable]:
    """A test module's fixtures ``checkpoint`` (``build(dir, seed=0)``, once per module) and ``fp32_pair`` (our model
    and transformers' loaded from it): ``checkpoint, fp32_pair = tiny_checkpoint_fixtures(build_tiny_flint, "flint")``."""

    @pytest.fixture(scope="module", name="checkpoint")
    def checkpoint_fixture(tmp_path_factory):
        return build(tmp_path_factory.mktemp(name), seed=0)

    @pytest.fixture(scope="module", name="fp32_pair")
    def fp32_pair_fixture(checkpoint):
        return load_model(checkpoint), load_reference(checkpoint)

    return checkpoint_fixture, fp32_pair_fixture


def check_checkpoint_logits(
    path: Path, lengths: tuple[int, ...], seed: int, rtol: float, max_outlier_rows: float = 0.0
) -> Model:
    """Load ``path`` with dgpp and with transformers and ``check_logits`` on prompts of ``lengths`` (``seed``): a
    config variant or another dtype of a family's tiny checkpoint. Returns our model."""
    model, ref = load_model(path), load_reference(path)
    prompts = conf.make_prompts(model.info.vocab_size, lengths, seed=seed)
    conf.check_logits(model, ref, prompts, rtol=rtol, max_outlier_rows=max_outlier_rows)
    return model


class FamilyConformance:
    """Logits and 32 greedy tokens against transformers; chunked prefill, mixed batches and bit-exact batch and
    chunk invariance against our own one-shot run."""

    logits_lengths: tuple[int, ...] = DEFAULT_LENGTHS
    greedy_lengths: tuple[int, ...] = (7, 19)
    greedy_seed: int = 1
    chunked_lengths: tuple[int, ...] = (11, 23)
    chunked_seed: int = 2
    chunk_sizes: tuple[int, ...] = (1, 5, 16)
    chunked_new_tokens: int = 8
    invariance_lengths: tuple[int, ...] = (11, 23, 4, 1)
    invariance_seed: int = 2
    invariance_chunk_sizes: tuple[int, ...] = (1, 5)
    chunk_rtol: float = 0.0  # 0: chunked rows bit-identical to one-shot
    mixed_lengths: tuple[int, ...] = (3, 17, 9)
    mixed_seed: int = 3
    mixed_new_tokens: int = 8

    def test_logits_match_transformers(self, fp32_pair):
        model, ref = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.logits_lengths)
        assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4

    def test_32_greedy_tokens_match_transformers_generate(self, fp32_pair):
        model, ref = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.greedy_lengths, seed=self.greedy_seed)
        conf.check_greedy(model, ref, prompts, max_new_tokens=32)
        assert [len(t) for t in greedy_generate(model, prompts, 32)] == [32] * len(prompts)  # no early EOS

    def test_chunked_prefill_equals_one_shot(self, fp32_pair):
        model, _ = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.chunked_lengths, seed=self.chunked_seed)
        conf.check_chunked_prefill(
            model, prompts, chunk_sizes=self.chunk_sizes, max_new_tokens=self.chunked_new_tokens
        )

    def test_rows_bit_identical_chunked_batched_or_alone(self, fp32_pair):
        model, _ = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.invariance_lengths, seed=self.invariance_seed)
        conf.check_batch_invariance(model, prompts)
        conf.check_chunk_invariance(
            model, prompts, chunk_sizes=self.invariance_chunk_sizes, rtol=self.chunk_rtol
        )

    def test_mixed_prefill_decode_batch_equals_solo(self, fp32_pair):
        model, _ = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.mixed_lengths, seed=self.mixed_seed)
        conf.check_mixed_batch(model, prompts, max_new_tokens=self.mixed_new_tokens)


class HybridConformance(FamilyConformance):
    """``FamilyConformance`` with longer runs, plus the state snapshot (window rings, open compression windows)."""

    # for a window of 8: 5 and 7 fit in it; 23 and 30 run past it, so their late rows see neither the first keys
    # nor, via the ring, anything older than the window
    logits_lengths = (5, 23, 7, 30)
    greedy_lengths, greedy_seed = (5, 19), 2
    chunked_lengths, chunked_seed, chunk_sizes, chunked_new_tokens = (6, 27), 2, (1, 3, 16), 10
    invariance_lengths, invariance_seed, invariance_chunk_sizes = (4, 23, 12, 1), 3, (1, 5, 11)
    mixed_lengths, mixed_seed, mixed_new_tokens = (3, 17, 9), 4, 12
    snapshot_length: int = 26
    snapshot_split: int = 16

    def test_state_snapshot_restores_the_state(self, fp32_pair):
        """What a prefix-cache hit does: the state restored from a snapshot at the cut continues exactly as the
        cold run."""
        model, _ = fp32_pair
        prompt = conf.make_prompts(model.info.vocab_size, (self.snapshot_length,), seed=5)[0]
        conf.check_state_snapshot(model, prompt, split=self.snapshot_split)


class KVFp8Lever:
    """``engine.kv_dtype: fp8`` on a family's fp32 checkpoint, gated against the exact chain: the pools hold 1-byte
    codes beside fp32 row scales; the logits move from the exact chain's by a nonzero amount, each row's largest
    move within ``kv_fp8_row_bound`` of the exact chain's max |logit| for all but ``kv_fp8_outlier_rows`` of the
    rows (an MoE router may flip an expert at a near-tie: a whole-row jump) and within ``kv_fp8_worst_bound`` for
    every row; and batched == alone, chunked == one-shot (logits bit for bit with ``kv_fp8_logit_chunks``, greedy
    tokens with ``kv_fp8_greedy_chunks``), a mixed batch == solo and a prefix hit == the cold run hold with the
    lever on. The format under test is the ``kv_lever_dtype`` fixture (``dgpp.testing.latent_lever`` runs these
    checks for MLA latents under fp8 and fp4)."""

    kv_fp8_lengths: tuple[int, ...] = (11, 23, 4, 1)
    kv_fp8_seed: int = 2
    kv_fp8_logit_chunks: tuple[int, ...] = (1, 5)
    kv_fp8_greedy_chunks: tuple[int, ...] = (1, 5, 16)
    kv_fp8_row_bound: float = 0.1
    kv_fp8_outlier_rows: float = 0.1
    kv_fp8_worst_bound: float = 0.5
    kv_fp8_new_tokens: int = 8
    # (prompt length, shared 16-token blocks) of the prefix-hit check
    kv_fp8_prefix: tuple[int, int] = (40, 2)

    @pytest.fixture(name="kv_lever_dtype")
    def kv_lever_dtype_fixture(self) -> str:
        return "fp8"

    def lever_bounds(self, kv_dtype: str) -> tuple[float, float, float]:
        """(row bound, outlier row share, worst row bound) of the logit move under ``kv_dtype``."""
        return self.kv_fp8_row_bound, self.kv_fp8_outlier_rows, self.kv_fp8_worst_bound

    def test_kv_fp8_pools_hold_one_byte_codes_and_row_scales(self, fp32_pair):
        model, _ = fp32_pair
        pools, _, _ = make_pools(model, [32], 16, "fp8")
        assert pools.kv or pools.state
        for name, (k, v) in pools.kv.items():
            assert k.dtype == v.dtype == KV_FP8 and k.element_size() == v.element_size() == 1, name
            k_scale, v_scale = pools.kv_scales[name]
            assert k_scale.shape == (*k.shape[:3], 1) and v_scale.shape == (*v.shape[:3], 1), name
        for ring in (ring for ring in pools.state.values() if "k_scale" in ring):
            assert ring["k"].dtype == ring["v"].dtype == KV_FP8
        exact, _, _ = make_pools(model, [32], 16)
        assert pools.kv_bytes() + pools.state_bytes() < exact.kv_bytes() + exact.state_bytes()

    def test_kv_lever_logits_move_within_bound_of_the_exact_chain(self, fp32_pair, kv_lever_dtype):
        model, _ = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.kv_fp8_lengths, seed=self.kv_fp8_seed)
        exact = torch.cat(conf.engine_all_logits(model, prompts))
        lossy = torch.cat(conf.engine_all_logits(model, prompts, kv_dtype=kv_lever_dtype))
        rows = (lossy - exact).abs().amax(-1) / float(exact.abs().max())
        row_bound, outlier_rows, worst_bound = self.lever_bounds(kv_lever_dtype)
        assert bool(torch.isfinite(rows).all()) and float(rows.max()) > 0, "the lever changed no logit"
        assert float(rows.max()) <= worst_bound, float(rows.max())
        outliers = float((rows > row_bound).float().mean())
        assert outliers <= outlier_rows, (outliers, rows.tolist())

    def test_kv_lever_rows_bit_identical_chunked_batched_or_alone(self, fp32_pair, kv_lever_dtype):
        model, _ = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.kv_fp8_lengths, seed=self.kv_fp8_seed)
        conf.check_batch_invariance(model, prompts, kv_dtype=kv_lever_dtype)
        conf.check_chunk_invariance(
            model, prompts, chunk_sizes=self.kv_fp8_logit_chunks, kv_dtype=kv_lever_dtype
        )

    def test_kv_lever_chunked_and_mixed_greedy_equal_one_shot_solo(self, fp32_pair, kv_lever_dtype):
        model, _ = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.kv_fp8_lengths[:3], seed=self.kv_fp8_seed)
        conf.check_chunked_prefill(
            model, prompts, self.kv_fp8_greedy_chunks, self.kv_fp8_new_tokens, kv_dtype=kv_lever_dtype
        )
        conf.check_mixed_batch(model, prompts, self.kv_fp8_new_tokens, kv_dtype=kv_lever_dtype)

    def test_kv_lever_prefix_hit_equals_cold(self, fp32_pair, kv_lever_dtype):
        """The quantized blocks with their scales (and, for hybrid models, the state snapshot with its e4m3 rings)
        shared by a prefix hit continue exactly as the cold run."""
        model, _ = fp32_pair
        length, shared = self.kv_fp8_prefix
        prompt = conf.make_prompts(model.info.vocab_size, (length,), seed=5)[0]
        conf.check_prefix_hit(model, prompt, shared, self.kv_fp8_new_tokens, kv_dtype=kv_lever_dtype)
