"""``engine.kv_dtype: fp8`` on Qwen3 (paged GQA) and the Qwen3.5 hybrid (paged GQA beside GDN state), gated against
the exact chain (``dgpp.testing.suite.KVFp8Lever``); Qwen4-exp's QSA keys are refused under it."""

from __future__ import annotations

import pytest

from dgpp.errors import ConfigError
from dgpp.startup.loading import load_model
from dgpp.step.cache_spec import stored_as
from dgpp.testing.builders import build_tiny_checkpoint, load_reference
from dgpp.testing.suite import KVFp8Lever


def _pair(kind: str, tmp_path_factory):
    path = build_tiny_checkpoint(kind, tmp_path_factory.mktemp(kind))
    return load_model(path), load_reference(path)


class TestQwen3KVFp8(KVFp8Lever):
    @pytest.fixture(scope="class")
    def fp32_pair(self, tmp_path_factory):
        return _pair("qwen3", tmp_path_factory)


class TestQwen3_5KVFp8(KVFp8Lever):
    @pytest.fixture(scope="class")
    def fp32_pair(self, tmp_path_factory):
        return _pair("qwen3_5", tmp_path_factory)


def test_qsa_keys_are_refused_under_fp8(tmp_path):
    from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

    model = load_model(build_tiny_qwen4_exp(tmp_path))
    with pytest.raises(ConfigError, match="engine.kv_dtype: 'fp8'.*PagedKV"):
        stored_as(model.cache_spec(), "fp8")
