"""The served-vs-runner check family serve tests share: a cold request, a prefix-cache hit and concurrent requests
all return exactly the runner's greedy tokens for the same rendered prompts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from dgpp.engine.loading import load_model
from dgpp.testing.generate import greedy_generate
from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer

NO_THINK = {"enable_thinking": False}


def chat_messages(question: str) -> list[dict]:
    """A long shared system prompt (so a repeat hits the prefix cache) and one question."""
    return [{"role": "system", "content": "You are a helpful assistant. Think step by step. " * 3},
            {"role": "user", "content": question}]


def check_served_greedy(ckpt: Path, sdk: openai.OpenAI, questions: tuple[str, ...], min_prompt_tokens: int,
                        max_tokens: int = 12) -> None:
    """Cold, hit (at least 16 cached tokens) and concurrent answers equal the runner's greedy continuation; every
    rendered prompt is longer than ``min_prompt_tokens``."""

    def ask(question: str, **extra) -> openai.types.chat.ChatCompletion:
        return sdk.chat.completions.create(model=str(ckpt), messages=chat_messages(question), max_tokens=max_tokens,
                                           temperature=0,
                                           extra_body={"ignore_eos": True, "chat_template_kwargs": NO_THINK, **extra})

    tok = Tokenizer.from_dir(ckpt)
    template = ChatTemplate.for_checkpoint(tok)
    model = load_model(ckpt)
    prompts = [tok.encode(template.render(chat_messages(q), chat_template_kwargs=NO_THINK)) for q in questions]
    assert min(len(p) for p in prompts) > min_prompt_tokens
    want = [tok.decode(t, skip_special_tokens=True)
            for t in greedy_generate(model, prompts, max_tokens, stop_at_eos=False)]

    cold = ask(questions[0], prefix_cache=False)
    ask(questions[0])
    hit = ask(questions[0])
    assert cold.choices[0].message.content == hit.choices[0].message.content == want[0]
    assert hit.usage.prompt_tokens_details.cached_tokens >= 16
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(lambda q: ask(q).choices[0].message.content, questions))
    assert together == want
