"""Qwen3.5 hybrids in bf16 (the release dtype): logits within a stated tolerance of transformers in bf16, and greedy
tokens identical except where transformers' own choice is a bf16 near-tie. The GDN state stays fp32."""

from __future__ import annotations

import math

import pytest
import torch

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint, load_reference

# bf16 keeps 8 mantissa bits (relative step 2^-8 ≈ 4e-3); both sides round every projection, norm and
# residual, but in different places (our attention softmax·V and conv accumulate in fp32), over 4 layers.
BF16_RTOL = 3e-2
# Logits come out of a bf16 head, so two candidates a few ulps apart may swap between exact-in-fp32 but
# differently rounded implementations. A divergence is accepted only at such a near-tie of the reference.
TIE_ULPS = 4


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def _check_greedy_up_to_near_ties(model, ref, prompt: list[int], max_new_tokens: int) -> int:
    """Returns how many leading tokens match transformers' generate; fails unless they all match or the
    first mismatch is at a reference near-tie (top-2 gap within ``TIE_ULPS`` bf16 ulps)."""
    ours = greedy_generate(model, [prompt], max_new_tokens)[0]
    theirs = conf.reference_greedy(ref, prompt, max_new_tokens)
    if ours == theirs:
        return len(ours)
    at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + theirs[:at]])).logits[0, -1].float()
    best, second = logits.topk(2).values.tolist()
    assert best - second <= TIE_ULPS * _bf16_ulp(best), (
        f"greedy differs at token {at} where transformers' choice is clear "
        f"(top-2 gap {best - second:.4g} > {TIE_ULPS} ulps): {ours[at : at + 4]} vs {theirs[at : at + 4]}"
    )
    return at


@pytest.mark.parametrize("kind", ("qwen3_5_moe_vl",))  # GDN, gated attention, MoE and the wrapper in one
def test_bf16_logits_within_tolerance_and_greedy_matches(kind, tmp_path):
    path = build_tiny_checkpoint(kind, tmp_path, dtype=torch.bfloat16, seed=9)
    model, ref = load_model(path), load_reference(path)
    assert model.info.dtype == torch.bfloat16
    spec = model.cache_spec()["layers.0"].tensors
    assert spec["recurrent"][1] == torch.float32 and spec["conv"][1] == torch.bfloat16
    prompts = conf.make_prompts(model.info.vocab_size, (6, 70), seed=10)
    worst = conf.check_logits(model, ref, prompts, rtol=BF16_RTOL)
    matched = [_check_greedy_up_to_near_ties(model, ref, p, 32) for p in prompts]
    print(f"{kind} bf16: worst relative logit error {worst:.3g}; greedy tokens matched {matched} of 32")
    assert min(matched) >= 8
