"""The drafts a served request gets are the drafter's own prediction, not merely harmless: greedy MTP == plain
holds whatever the drafter proposes, so a drafter fed the wrong hidden rows, tokens or K/V positions (backlog,
chunked prefill, a prefix-cache hit) would pass every transcript test and only cost acceptance. Each decode's
first draft must equal the drafter's argmax at ``c - 1`` recomputed from scratch (``dgpp.testing.mtp``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_speculative import glm, serve  # noqa: E402,F401 - glm is the module fixture

from dgpp.engine.speculative import SpeculativeDecoder  # noqa: E402
from dgpp.testing.mtp import draft_logits  # noqa: E402


def test_first_drafts_equal_the_drafter_recomputed_from_scratch(glm, monkeypatch):  # noqa: F811
    model, drafter = glm
    seen: list[tuple[list[int], int]] = []  # (tokens with the last one not yet fed, its first draft)
    inner = SpeculativeDecoder._draft

    def recording(self, seqs, depths, rule=None):
        drafts = inner(self, seqs, depths, rule)
        seen.extend((list(s.tokens), d[0]) for s, d in zip(seqs, drafts.lists(), strict=True) if d)
        return drafts

    monkeypatch.setattr(SpeculativeDecoder, "_draft", recording)
    serve(model, drafter, 2)
    assert len(seen) >= 10
    for tokens, first in seen:
        logits = draft_logits(model, drafter, tokens, [len(tokens) - 1])[-1]
        best = int(torch.argmax(logits))
        # a near-tie may break differently between batched and solo rows; anything else is a wrong input
        assert first == best or float(logits[best] - logits[first]) < 1e-4, (len(tokens), first, best)
