"""Qwen3.5 hybrids (qwen3_5 dense, qwen3_5_moe, and their ConditionalGeneration wrappers) against transformers
on tiny random fp32 checkpoints: logits, greedy generation, chunked prefill, mixed batches, state snapshots."""

from __future__ import annotations

import pytest
import torch

from dgpp.engine.cache_spec import PagedKV, StateSpec
from dgpp.sched.work import SeqWork
from qwen3_5_support import KINDS, StepDriver, blocks, build_hf_model, greedy, load_dgpp, save_checkpoint

PROMPT_LENS = (5, 17, 70)  # 70 > the 64-token GDN chunk


def _prompts(seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    """(transformers model, dgpp model) for one kind, from one saved checkpoint."""
    hf = build_hf_model(request.param)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_dgpp(path)


def _hf_logits(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def test_cache_spec_follows_layer_types(pair):
    _, model = pair
    spec = model.cache_spec()
    assert [type(s) for s in spec.values()] == [StateSpec, StateSpec, StateSpec, PagedKV]
    gdn = spec["layers.0"].tensors
    assert gdn["recurrent"] == ((4, 16, 16), torch.float32)
    assert gdn["conv"] == ((3, 2 * 2 * 16 + 4 * 16), torch.float32)
    assert spec["layers.3"] == PagedKV(num_kv_heads=2, head_dim=16, dtype=torch.float32)
    assert model.info.hybrid


def test_logits_match_transformers_on_a_batch(pair):
    hf, model = pair
    prompts = _prompts()
    driver = StepDriver(model)
    works = [SeqWork(i, blocks(24 * i, 24), 0, p) for i, p in enumerate(prompts)]
    ours = driver.step(works, all_rows=True).split(PROMPT_LENS)
    for prompt, got in zip(prompts, ours):
        ref = _hf_logits(hf, prompt)
        rel = (got - ref).abs().max() / ref.abs().max()
        assert rel < 1e-4, f"relative error {rel:.2e} for a {len(prompt)}-token prompt"


def test_greedy_32_tokens_match_generate(pair):
    hf, model = pair
    prompts = _prompts(seed=2)
    ours = greedy(StepDriver(model), prompts, 32)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        assert got == ref[0, len(prompt) :].tolist()
