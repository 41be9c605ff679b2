"""Sampling: penalties, logit bias, masks, temperature / top-k / min-p / top-p, seeded draws, logprobs."""

from dgpp.sample.params import SamplingDefaults, SamplingParams
from dgpp.sample.sampler import ChoiceSampler, SampleResult, filtered_distribution

__all__ = ["ChoiceSampler", "SampleResult", "SamplingDefaults", "SamplingParams", "filtered_distribution"]
