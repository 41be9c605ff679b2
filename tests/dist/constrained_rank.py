"""One rank of a test world serving grammar-constrained chat requests (a json_schema answer with two seeded
choices, a required tool call) beside a plain one: rank 0 prepares them through the serving layer (chat
template, constraint spec, matchers) and journals them; peers compile their own matchers from the journaled
spec. Each rank writes its op stream (``ops<rank>.txt``) and a result JSON."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import torch

from dgpp.config import parse_config
from dgpp.dist.digest import OpStream
from dgpp.dist.follower import Follower
from dgpp.dist.journal import JournalWriter
from dgpp.dist.world import WorldSpec, form_world, settings_of
from dgpp.sample.params import SamplingParams
from dgpp.server_assembly import Rank0Wiring, build_backend
from dgpp.serve.protocol import ChatCompletionRequest
from dgpp.sample.sampler import SampleResult
from dgpp.sched.request import RetireReason, SeqEvent
from dgpp.serve.generation import generation_request
from dgpp.serve.output_processor import OutputProcessor

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Answer as JSON."}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    "chat_template_kwargs": {"enable_thinking": False},
}
LAMP_ARGS = {
    "type": "object",
    "properties": {"room": {"type": "string", "enum": ["hall", "kitchen"]},
                   "level": {"type": "integer", "minimum": 0, "maximum": 10}},
    "required": ["room", "level"],
    "additionalProperties": False,
}
TOOL_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Dim the hall."}],
    "tools": [{"type": "function", "function": {"name": "set_lamp", "strict": True, "parameters": LAMP_ARGS}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "chat_template_kwargs": {"enable_thinking": False},
}
N_CHOICES = 2
CONSTRAINED = SamplingParams(temperature=1.0, seed=7, max_tokens=96)
PLAIN = SamplingParams(temperature=0.0, max_tokens=6)  # an unconstrained request in the same batch


async def _serve(engine: Any) -> dict[str, Any]:
    prepared = await engine.prepare_chat(msgspec.convert(CHAT, ChatCompletionRequest), N_CHOICES)
    tool = await engine.prepare_chat(msgspec.convert(TOOL_CHAT, ChatCompletionRequest), 1)
    def request(prompt_ids, params, n=1, matchers=None, constraint=None):
        return generation_request("cmpl", prompt_ids, params, engine.limits, named_limit=True,
                                  token_text=engine.token_text, n=n, matchers=matchers, constraint=constraint)

    handles = [
        engine.submit(request(prepared.prompt_ids, CONSTRAINED, N_CHOICES, prepared.matchers, prepared.constraint)),
        engine.submit(request(prepared.prompt_ids[:9], PLAIN)),
        engine.submit(request(tool.prompt_ids, CONSTRAINED, 1, tool.matchers, tool.constraint)),
    ]
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for handle in handles:
        while not handle.finished:
            choice, ev = await asyncio.wait_for(handle.queue.get(), 120)
            rid = handle.request.choice_id(choice)
            tokens.setdefault(rid, []).extend(ev.tokens)
            if ev.retired is not None:
                handle.done.add(choice)
                reasons[rid] = ev.retired.value
    constrained = [handles[0].request.choice_id(i) for i in range(N_CHOICES)]
    texts = {rid: engine.tokenizer.decode(tokens[rid], skip_special_tokens=True) for rid in constrained}
    call = OutputProcessor(0, engine.tokenizer, SamplingParams(), engine.eos_token_ids, prompt=tool.prompt_text,
                           dialect=engine.dialect, tools=tool.tools)
    ids = tokens[handles[2].request.choice_id(0)]
    call.feed(SeqEvent(tokens=ids, samples=[SampleResult(t) for t in ids], retired=RetireReason.EOS))
    calls = [[c.name, c.arguments] for c in call.tool_calls]
    return {"tokens": tokens, "reasons": reasons, "texts": texts, "constraint": prepared.constraint, "calls": calls}


def run_constrained_rank(rank: int, raw_cfg: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = parse_config(raw_cfg)
    out = Path(out_dir)
    world = form_world(WorldSpec.from_config(cfg, rank), settings_of(cfg), device="cpu")
    orderly = False
    try:
        stream = OpStream(out / f"ops{rank}.txt")
        hub = world.hub
        rank0 = Rank0Wiring(journal_for=lambda scheduler: JournalWriter(hub, scheduler, stream),
                            name_departures=lambda runner, spec: (runner, spec)) if rank == 0 else None
        engine = build_backend(cfg, device="cpu", start_loop=False, world=world.world, group=world.group, rank0=rank0)
        torch.distributed.barrier()
        result: dict[str, Any] = {}
        if rank == 0:
            loop = engine.loop
            writer = loop.journal
            world.hub.watch(loop.fail)
            loop.start()
            try:
                result.update(asyncio.run(_serve(engine)))
            finally:
                loop.stop()
            result["failed"] = loop.failed
            result["digests"] = writer.stop()
        else:
            follower = Follower(world.link, engine.loop.scheduler, engine.limits.vocab_size, stream, rank,
                                constraint_matcher=engine.constraint_matcher)
            result["exit"] = follower.run()
            result["error"] = follower.error
        result["digest"] = stream.full_digest()
        stream.close()
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        orderly = True
    finally:
        world.close(orderly=orderly)
