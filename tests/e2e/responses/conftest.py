"""One ``dgpp serve`` of a tiny Qwen3 checkpoint (its template has a tool dialect and a thinking switch) for every
Responses test in this directory, driven by the openai SDK."""

from __future__ import annotations

import openai
import pytest
from responses_client import ENGINE, STORE_BYTES
from serve_fixture import Server, tiny_checkpoint

from dgpp.text.chat_template import ChatTemplate
from dgpp.text.tokenizer import Tokenizer


@pytest.fixture(scope="package")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("responses")
    ckpt = tiny_checkpoint("qwen3", root)
    server = Server(ckpt, root, ENGINE, http={"responses_store_bytes": STORE_BYTES})
    try:
        server.wait_ready()
        tok = Tokenizer.from_dir(ckpt)
        yield {
            "server": server,
            "tok": tok,
            "template": ChatTemplate.for_checkpoint(tok),
            "model": str(ckpt),
            "sdk": openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        }
    finally:
        server.stop()
