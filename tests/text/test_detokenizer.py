"""Streaming detokenization: equal to one-shot decoding for every prefix; stop strings held back and exact."""

from __future__ import annotations

import pytest

from dgpp.text.detokenizer import IncrementalDetokenizer

TEXT = "Hi 你好 😀👨‍👩‍👧 naïve, <think>why</think> 中文 ok 🇯🇵!"


def test_streamed_equals_one_shot_for_every_prefix(any_tokenizer):
    ids = any_tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(any_tokenizer)
    for k, tid in enumerate(ids, start=1):
        detok.push(tid)
        assert "\ufffd" not in detok.text  # never half a character
        # what was emitted plus what a finish would flush is the one-shot decode of this prefix
        probe = IncrementalDetokenizer(any_tokenizer)
        streamed = probe.push_many(ids[:k]) + probe.finish()
        assert streamed == any_tokenizer.decode(ids[:k])
    assert detok.text + detok.finish() == TEXT


def test_split_utf8_tail_becomes_replacement_at_finish(deepseek_v4):
    # a lone emoji byte-piece: the first byte-level token of a multi-token character
    ids = deepseek_v4.encode("😀")
    if len(ids) < 2:
        pytest.skip("emoji is one token in this vocabulary")
    detok = IncrementalDetokenizer(deepseek_v4)
    assert detok.push(ids[0]) == ""
    assert detok.finish() == deepseek_v4.decode(ids[:1])


@pytest.mark.parametrize("stop", ["STOP", "\n\n", "好 😀", "x"])
def test_stop_string_exact(any_tokenizer, stop):
    text = "alpha beta 你好 😀 gamma STOP delta\n\nx"
    ids = any_tokenizer.encode(text)
    detok = IncrementalDetokenizer(any_tokenizer, stop=[stop])
    out = ""
    for tid in ids:
        out += detok.push(tid)
        # nothing emitted ever contains the stop string or ends in one of its proper prefixes
        assert stop not in out
    assert detok.stopped is not None
    match = detok.stopped
    assert match.stop == stop and out == match.text == text[: text.index(stop)]
    # the reported token is the first prefix whose decode contains the stop string
    first = next(k for k in range(1, len(ids) + 1) if stop in any_tokenizer.decode(ids[:k]))
    assert match.token_index == first - 1
    assert detok.push(ids[0]) == "" and detok.finish() == ""


def test_possible_stop_prefix_is_released_when_it_diverges(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, stop=["<END>", "world!"])
    out = detok.push_many(tiny_tokenizer.encode("hello world"))
    assert out == "hello " and detok.stopped is None  # "world" may still become "world!"
    out += detok.push_many(tiny_tokenizer.encode(" <EN"))
    out += detok.finish()
    assert out == "hello world <EN" and detok.stopped is None


def test_earliest_stop_wins(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, stop=["fox", "brown"])
    detok.push_many(tiny_tokenizer.encode("The quick brown fox"))
    assert detok.stopped.stop == "brown" and detok.text == "The quick "


def test_skip_ids_produce_no_text(tiny_tokenizer):
    eos = tiny_tokenizer.token_to_id("<|im_end|>")
    detok = IncrementalDetokenizer(tiny_tokenizer, skip_ids=[eos])
    ids = tiny_tokenizer.encode("Hello") + [eos]
    assert detok.push_many(ids) + detok.finish() == "Hello"
    assert detok.num_tokens == len(ids)


def test_non_byte_level_tokenizer_streams_like_one_shot():
    """A SentencePiece-style (Metaspace) vocabulary goes through the re-decoding window path."""
    from tokenizers.implementations import SentencePieceBPETokenizer

    from dgpp.text.tokenizer import Tokenizer

    sp = SentencePieceBPETokenizer()
    corpus = [
        "The quick brown fox jumps over the lazy dog.",
        "Hello world, hello there!",
        "你好 世界 😀 ok",
    ] * 5
    sp.train_from_iterator(
        corpus, vocab_size=200, min_frequency=1, show_progress=False, special_tokens=["<unk>", "</s>"]
    )
    tok = Tokenizer(sp._tokenizer, {"eos_token": "</s>"})
    assert not tok.is_byte_level
    ids = tok.encode(" Hello  world, the lazy 你好 😀 fox.")
    for k in range(1, len(ids) + 1):
        detok = IncrementalDetokenizer(tok, stop=["lazy 你"])
        streamed = detok.push_many(ids[:k]) + detok.finish()
        expected = tok.decode(ids[:k])
        assert streamed == expected.split("lazy 你")[0]


def test_ids_past_the_tokenizer_have_no_text(deepseek_v3):
    """Models pad their vocabulary (DeepSeek-V3: 129,280 rows, 128,815 tokenizer ids)."""
    detok = IncrementalDetokenizer(deepseek_v3)
    assert detok.push(129000) == "" and detok.push_many(deepseek_v3.encode("ok")) == "ok"


def test_ids_past_a_tiny_vocabulary_have_no_text(tiny_tokenizer):
    """Tiny fixture models pad vocab to 512 past the tokenizer; both decoder paths give such ids no text."""
    from tokenizers.implementations import SentencePieceBPETokenizer

    from dgpp.text.tokenizer import Tokenizer

    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(["hello world"] * 5, vocab_size=60, min_frequency=1, show_progress=False)
    window = Tokenizer(sp._tokenizer, {})
    for tok in (tiny_tokenizer, window):
        detok = IncrementalDetokenizer(tok, stop=["wor"])
        past = tok.vocab_size
        assert detok.push(past) == "" and detok.push(past + 100) == ""
        assert detok.push_many(tok.encode(" hello")).strip() == "hello"
        assert detok.push(past) == "" and detok.push_many(tok.encode(" world")) + detok.finish() == " "
        assert detok.stopped.stop == "wor" and detok.stopped.token_index == detok.num_tokens - 1
        assert detok.text.strip() == "hello"
