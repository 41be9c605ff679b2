"""End to end: ``dgpp serve`` on a tiny GLM-5.3-Flash checkpoint as the NVFP4-FP8 release ships it (``dgpp_mixed``:
NVFP4 routed experts, FP8 blocks elsewhere, an FP8 MTP layer, vision tensors) with speculation on (``engine.mtp``,
depth 2) and GLM's own chat template, through the openai SDK: cold, prefix-hit and concurrent answers are exactly
the runner's plain greedy tokens, on prompts past the indexer's dense limit."""

from __future__ import annotations

import httpx
import pytest
from served_greedy import QUESTIONS, SERVE_ENGINE, check_served_greedy, served

from dgpp_glm.dialect import chat_template
from dgpp_glm.testing_glm5_next_release import write_release_checkpoint

pytestmark = pytest.mark.e2e


def test_served_release_greedy_with_mtp_equals_the_plain_runner(tmp_path) -> None:
    packed, _ = write_release_checkpoint(tmp_path / "packed", tmp_path / "twin", seed=71)
    (packed / "chat_template.jinja").write_text(
        chat_template(), encoding="utf-8"
    )  # GLM's, for server and runner
    engine = {**SERVE_ENGINE, "mtp": True, "mtp_depth": 2}
    with served(packed, tmp_path, chat_template=False, engine=engine) as (server, sdk):
        check_served_greedy(packed, sdk, QUESTIONS, min_prompt_tokens=12)  # 3+ complete pools: sparse rows
        spec = httpx.get(server.url + "/metrics", timeout=10).json()["scheduler"]["spec_decode"]
    assert spec["depth"] == 2 and spec["drafter"] == "mtp" and spec["num_draft_tokens_total"] > 0
