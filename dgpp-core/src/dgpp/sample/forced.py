"""A sampler that emits a fixed token sequence and reports each token's logprob under the model: how a
prompt is scored (legacy completions' ``echo`` with ``logprobs``, as log-likelihood harnesses ask).

Fed one prompt token at a time, the engine's logits row at step ``i`` is the model's distribution for
prompt token ``i + 1`` given the ones before it, exactly as a prefill row would give it. The logprobs are
the raw model's (log-softmax of the fp32 logits: no temperature, penalty or bias), as vLLM reports
prompt logprobs.
"""

from __future__ import annotations

import torch

from dgpp.sample.params import SamplingParams
from dgpp.sample.sampler import ChoiceSampler, SampleResult, result_with_logprobs


class ForcedSampler(ChoiceSampler):
    """Returns ``tokens`` in order, whatever the logits say, with their logprobs and ``top`` alternatives."""

    samples_alone = True  # the batch draw hands this row to ``sample``

    def __init__(self, tokens: list[int], vocab_size: int, prompt_ids: list[int], top: int) -> None:
        # ignore_eos: a prompt may hold the EOS id (documents joined by it), and scoring must walk past it
        params = SamplingParams(
            temperature=0.0, logprobs=True, top_logprobs=top, max_tokens=max(len(tokens), 1), ignore_eos=True
        )
        super().__init__(params, vocab_size, prompt_ids)
        self.tokens = list(tokens)
        self.at = 0

    def sample(self, logits: torch.Tensor) -> SampleResult:
        if self.at >= len(self.tokens):
            raise ValueError("the forced sequence is exhausted")
        token = self.tokens[self.at]
        self.at += 1
        logprobs = torch.log_softmax(logits.detach().to(dtype=torch.float32), dim=0)
        return result_with_logprobs(token, logprobs, self.params.top_logprobs)

    def accept(self, token: int) -> None:
        """Nothing to record: no penalty or grammar applies to a forced token."""
