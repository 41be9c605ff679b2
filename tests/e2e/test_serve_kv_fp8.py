"""End to end with ``engine.kv_dtype: fp8`` on a tiny MiMo-V2-Flash (paged full layers and sliding rings, both with
sinks; window 8, far shorter than the prompts): the startup log names the lossy lever, and cold, prefix-hit and
concurrent answers through the openai SDK all equal the runner's greedy tokens over e4m3 K/V, which differ from
the exact chain's."""

from __future__ import annotations

import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, chat_messages, check_served_greedy, served

from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer
from dgpp_mimo.testing import build_tiny_mimo

pytestmark = pytest.mark.e2e
WINDOW = 8
NO_THINK = {"enable_thinking": False}


def test_fp8_kv_served_greedy_equals_the_runner_cold_hit_and_concurrent(tmp_path) -> None:
    ckpt = build_tiny_mimo(tmp_path / "ckpt", seed=21, vocab_size=512, sliding_window=WINDOW)
    with served(ckpt, tmp_path, engine={**SERVE_ENGINE, "kv_dtype": "fp8"}) as (server, sdk):
        check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=4 * WINDOW, kv_dtype="fp8")
        log = server.log.read_text()
    assert "lossy lever on" in log and "engine.kv_dtype" in log
    # the lever is not silently off: over these prompts its greedy tokens leave the exact chain's somewhere
    tok = Tokenizer.from_dir(ckpt)
    template = ChatTemplate.for_checkpoint(tok)
    prompts = [
        tok.encode(template.render(chat_messages(q), chat_template_kwargs=NO_THINK)) for q in QUESTIONS
    ]
    model = load_model(ckpt)
    exact = greedy_generate(model, prompts, 24, stop_at_eos=False)
    assert greedy_generate(model, prompts, 24, stop_at_eos=False, kv_dtype="fp8") != exact
