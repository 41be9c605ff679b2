"""Grammar-constrained decoding under tensor parallelism (world 2, gloo): rank 0 journals each constrained
choice's constraint spec with its admission, the peer compiles its own matcher from it, and both ranks
mask and sample identically: the same tokens on both ranks (read from each rank's op stream), equal digests,
JSON answers that validate against the schema and a required tool call with valid arguments."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import torch.multiprocessing as mp
from constrained_rank import CHAT, LAMP_ARGS, N_CHOICES, SCHEMA, run_constrained_rank
from tp_harness import deploy_dict

from dgpp.dist.records import Admission, Tick, decode, encode
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.tokenizers import build_tiny_tokenizer

WORLD = 2


def _op_tokens(path: Path) -> dict[str, list[int]]:
    """Every choice's tokens as a rank's op stream recorded them (``K <id> <token>`` lines)."""
    tokens: dict[str, list[int]] = {}
    for line in path.read_text().splitlines():
        if line.startswith("K "):
            _, rid, token = line.split()
            tokens.setdefault(rid, []).append(int(token))
    return tokens


def test_constraint_spec_travels_exactly():
    spec = {"response_format": CHAT["response_format"], "tools": None, "tool_choice": None,
            "parallel_tool_calls": True, "prompt_opens_thinking": False}
    tick = Tick(n=1, od="0", s=[[Admission(id="a/0", choice=0, p=[1, 2], sp={}, gs=5, g=spec)]])
    back = decode(encode(tick))
    assert back.s[0][0].g == spec
    assert decode(encode(Tick(n=1, od="0", s=[[Admission(id="b/0", choice=0, p=[1], sp={}, gs=5)]]))).s[0][0].g is None


def test_json_schema_request_identical_on_both_ranks(tmp_path):
    ckpt = build_tiny_checkpoint("qwen3", tmp_path / "ckpt", seed=3,
                                 overrides={"num_key_value_heads": 4, "tie_word_embeddings": True})
    build_tiny_tokenizer(ckpt)
    out = tmp_path / "w2"
    out.mkdir()
    mp.spawn(run_constrained_rank, args=(deploy_dict(ckpt, WORLD), str(out)), nprocs=WORLD, join=True)
    rank0, peer = (json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD))
    assert rank0["failed"] is None and peer["exit"] == 0, peer["error"]
    assert rank0["constraint"]["response_format"] == CHAT["response_format"]

    # both ranks emitted exactly the tokens rank 0 served (the peer masked with its own matcher)
    served = rank0["tokens"]
    assert len(served) == N_CHOICES + 2
    assert _op_tokens(out / "ops0.txt") == served
    assert _op_tokens(out / "ops1.txt") == served
    assert len(set(rank0["digests"].values())) == 1 and len(rank0["digests"]) == WORLD
    assert peer["digest"] == rank0["digest"]

    # the constraint really applied: each choice ended by the grammar with schema-valid JSON
    texts = rank0["texts"]
    assert len(texts) == N_CHOICES and len(set(texts.values())) == N_CHOICES, texts  # seeded choices differ
    for rid, text in texts.items():
        assert rank0["reasons"][rid] == "eos", (rid, text)  # the grammar ended it
        jsonschema.validate(json.loads(text), SCHEMA)

    # the required tool call (tools and tool_choice journaled too): exactly one valid call
    assert len(rank0["calls"]) == 1 and rank0["calls"][0][0] == "set_lamp", rank0["calls"]
    jsonschema.validate(json.loads(rank0["calls"][0][1]), LAMP_ARGS)
