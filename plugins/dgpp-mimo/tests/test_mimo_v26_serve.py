"""End to end: ``dgpp serve`` on a tiny MiMo-V2.6 checkpoint as shipped (fused FP8 qkv, MXFP4 experts, vision /
audio tensors, an MTP layer) with speculation on (``engine.mtp``, depth 2), through the openai SDK: cold, prefix
hit and concurrent answers are exactly the runner's plain greedy tokens."""

from __future__ import annotations

import httpx
import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp_mimo.testing import build_tiny_mimo
from dgpp_mimo.testing_v26 import write_v26_checkpoint

pytestmark = pytest.mark.e2e
WINDOW = 8


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v26_serve")
    flash = build_tiny_mimo(root / "flash", seed=51, vocab_size=512, sliding_window=WINDOW)
    v26, _ = write_v26_checkpoint(flash, root / "v26", root / "twin", mtp_layers=1, seed=52)
    with served(v26, root, engine={**SERVE_ENGINE, "mtp": True, "mtp_depth": 2}) as (server, sdk):
        yield v26, server, sdk


def test_served_greedy_with_mtp_equals_the_plain_runner(env) -> None:
    ckpt, server, sdk = env
    check_served_greedy(ckpt, sdk, QUESTIONS, min_prompt_tokens=4 * WINDOW)
    spec = httpx.get(server.url + "/metrics", timeout=10).json()["scheduler"]["spec_decode"]
    assert (
        spec["depth"] == 2 and spec["num_draft_tokens_total"] > 0
    )  # the MTP layer drafted every decode step
