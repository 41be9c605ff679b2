"""Decode benchmark: prompt length x batch x generated length, against the memory roofline and HF.

Per case it prints the bytes one decode step must read (weights once, MoE layers only the routed experts
the step picked, plus every sequence's K/V and hybrid GDN state read and written; ``dgpp.bench.step_bytes``),
ms per step, tok/s, the achieved GB/s and its share of the device-to-device copy bandwidth measured
in the same run, and transformers' tok/s (``generate``, greedy, eager) on the same weights.
The step is timed through ``ModelRunner.step`` (host batch building included); ``replay ms`` is
the captured graph alone, which separates GPU time from host time.

``kv_dtype`` (``engine.kv_dtype``) stores the cache as the engine would (``stored_as``: e4m3 rows with row scales
under ``fp8``, packed MLA latents under ``fp4``), the attention reading that form, and counts its bytes so. Prompts
are prefilled in steps of at most ``PREFILL_STEP_TOKENS`` rows (the engine's tick budget), so the activations of
long prompts fit beside the cache (8 prompts of 32K tokens are 262K rows: one step would need tens of GB).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dgpp.bench.step_bytes import (
    RouterTap,
    decode_step_bytes,
    expert_elements,
    kv_bytes_per_token,
    logical_weight_elements,
    moe_layers,
)
from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.work import SeqWork
from dgpp.prefill_budget import AUTO_BUSY_TOKENS
from dgpp.step.cache_spec import stored_as
from dgpp.step.model import Model
from dgpp.step.pools import CachePools

# prompt rows one bench prefill step carries at most: the engine's own prefill budget per tick
PREFILL_STEP_TOKENS = AUTO_BUSY_TOKENS

__all__ = ["DecodeResult", "DecodeSession", "kv_bytes_per_token", "run_case", "hf_tok_s", "format_table"]


@dataclass
class DecodeResult:
    """One benchmark case's numbers (times in ms, rates in tok/s and GB/s)."""

    prompt: int
    batch: int
    generated: int
    graph: bool
    step_bytes: float = 0.0
    ms_per_step: float = 0.0
    replay_ms: float = 0.0
    tok_s: float = 0.0
    gb_s: float = 0.0
    copy_pct: float = 0.0
    hf_tok_s: float = 0.0
    label: str = ""
    refused: str = ""  # why the case did not run (a kv dtype the model's attention does not read)
    tokens: list[list[int]] = field(default_factory=list)
    experts_read: float = 0.0  # MoE: distinct routed experts per layer in a measured step (0: not an MoE)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth_gbs(device: str, nbytes: int = 4 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus written (the method's ceiling)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del src, dst
    return nbytes / (sorted(times)[len(times) // 2] * 1e-3) / 1e9


class DecodeSession:
    """Pools and block tables for ``batch`` sequences of up to ``max_len`` tokens, every table full
    width (so eager and graph steps split attention identically). Sequence ``b`` owns state slot ``b``
    (hybrid models' GDN state; the runner zeroes it at the sequence's first prefill). ``kv_dtype``
    (``engine.kv_dtype``): the cache entries as the engine stores them (``stored_as``; ``ConfigError`` for a
    format the model's attention does not read)."""

    def __init__(
        self,
        model: Model,
        batch: int,
        max_len: int,
        block_size: int,
        graph: bool,
        kv_dtype: str = "auto",
    ) -> None:
        self.blocks_per_seq = -(-max_len // block_size)
        device = next(model.parameters()).device
        self.pools = CachePools(
            stored_as(model.cache_spec(), kv_dtype),
            batch * self.blocks_per_seq,
            block_size,
            batch,
            device=device,
        )
        self.tables = [
            list(range(b * self.blocks_per_seq, (b + 1) * self.blocks_per_seq)) for b in range(batch)
        ]
        self.runner = ModelRunner(
            model, self.pools, decode_graph=graph, max_batch=max(batch, 1), max_blocks=self.blocks_per_seq
        )

    def prefill(self, prompts: list[list[int]], step_tokens: int = 0) -> list[int]:
        """Every prompt cached, its greedy next token returned. ``step_tokens`` > 0: steps of at most that many
        rows, every prompt advancing by an equal chunk (0: one step of all prompts whole)."""
        if step_tokens <= 0:
            work = [SeqWork(b, self.tables[b], 0, p) for b, p in enumerate(prompts)]
            return torch.argmax(self.runner.step(work), dim=-1).tolist()
        chunk = max(1, step_tokens // max(1, len(prompts)))
        first = [0] * len(prompts)
        for start in range(0, max(map(len, prompts), default=0), chunk):
            live = [b for b, p in enumerate(prompts) if start < len(p)]
            work = [
                SeqWork(
                    b,
                    self.tables[b],
                    start,
                    prompts[b][start : start + chunk],
                    start + chunk >= len(prompts[b]),
                )
                for b in live
            ]
            logits = self.runner.step(work)
            done = [b for b, w in zip(live, work, strict=True) if w.want_logits]
            for b, token in zip(done, torch.argmax(logits, dim=-1).tolist(), strict=True):
                first[b] = token
        return first

    def decode(self, last: list[int], context: int, steps: int) -> list[list[int]]:
        out = [[t] for t in last]
        for s in range(steps):
            work = [SeqWork(b, self.tables[b], context + s, [out[b][-1]]) for b in range(len(last))]
            for b, t in enumerate(torch.argmax(self.runner.step(work), dim=-1).tolist()):
                out[b].append(t)
        return out

    def routed_experts(self, tokens: list[list[int]], context: int) -> float:
        """One more decode step of every sequence, eager, with the routers tapped: the mean distinct routed
        experts per MoE layer (the step reads exactly those). ``tokens[b][-1]`` is fed at ``context``."""
        work = [SeqWork(b, self.tables[b], context, [seq[-1]]) for b, seq in enumerate(tokens)]
        batch = build_batch(work, self.pools, self.runner.device)
        with RouterTap(self.runner.model, rows=len(tokens)) as tap:
            self.runner.model(batch)
        return tap.mean_distinct()


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


def run_case(
    model: Model,
    prompt: int,
    batch: int,
    generated: int,
    *,
    graph: bool,
    copy_gbs: float,
    block_size: int = 16,
    seed: int = 0,
    kv_dtype: str = "auto",
) -> DecodeResult:
    """Prefill ``batch`` random prompts (steps of at most ``PREFILL_STEP_TOKENS`` rows), then time
    ``generated - 1`` decode steps (greedy) with the cache stored as ``kv_dtype`` says."""
    res = DecodeResult(prompt, batch, generated, graph)
    # one slot more than generated: the MoE routing measurement steps once past the timed decode
    session = DecodeSession(model, batch, prompt + generated + 1, block_size, graph, kv_dtype)
    prompts = random_prompts(batch, prompt, model.info.vocab_size, seed)
    first = session.prefill(prompts, PREFILL_STEP_TOKENS)
    session.decode(first, prompt, 2)  # warm-up: compiles kernels, captures graphs
    _sync()
    steps = generated - 1
    t0 = time.perf_counter()
    res.tokens = session.decode(first, prompt, steps)
    _sync()
    elapsed = time.perf_counter() - t0
    res.ms_per_step = elapsed / steps * 1e3
    res.tok_s = batch * steps / elapsed
    mean_context = prompt + 1 + (steps - 1) / 2
    if moe_layers(model):
        res.experts_read = session.routed_experts(res.tokens, prompt + steps)
    res.step_bytes = decode_step_bytes(model, batch, mean_context, res.experts_read or None, kv_dtype)
    res.gb_s = res.step_bytes / (res.ms_per_step * 1e-3) / 1e9
    res.copy_pct = 100.0 * res.gb_s / copy_gbs
    graphs = session.runner.graphs
    if graphs is not None and graphs.captured:
        size = min(s for s in graphs.sizes if s >= batch)
        res.replay_ms = _time_replay(graphs.graphs[size])
    return res


def _time_replay(graph: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def hf_tok_s(
    hf: torch.nn.Module, prompt: int, batch: int, generated: int, vocab: int, seed: int = 0
) -> float:
    """transformers ``generate`` (greedy, eager, its default cache), decode rate after the first token;
    0.0 (shown as '-') without a transformers model (its version lacks the geometry's model type)."""
    if hf is None:
        return 0.0
    ids = torch.tensor(random_prompts(batch, prompt, vocab, seed), device=next(hf.parameters()).device)
    mask = torch.ones_like(ids)
    kwargs = {"do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    hf.generate(ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    _sync()
    t0 = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1, **kwargs)
    _sync()
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf.generate(ids, attention_mask=mask, max_new_tokens=generated, min_new_tokens=generated, **kwargs)
    _sync()
    decode_time = time.perf_counter() - t0 - t_first
    return batch * (generated - 1) / decode_time


def format_table(results: list[DecodeResult], copy_gbs: float) -> str:
    head = (
        "| prompt | batch | new | mode | bytes/step (GB) | ms/step | replay ms | tok/s | GB/s | % copy bw "
        "| HF tok/s | x HF |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        if r.refused:  # the reason is the variant's section
            lines.append(f"| {r.prompt} | {r.batch} | {r.generated} | {r.label} | refused |" + " - |" * 7)
            continue
        ratio = f"{r.tok_s / r.hf_tok_s:.1f}" if r.hf_tok_s else "-"
        hf = f"{r.hf_tok_s:.1f}" if r.hf_tok_s else "-"
        replay = f"{r.replay_ms:.2f}" if r.replay_ms else "-"
        lines.append(
            f"| {r.prompt} | {r.batch} | {r.generated} | {r.label or ('graph' if r.graph else 'eager')} | {r.step_bytes / 1e9:.2f} "
            f"| {r.ms_per_step:.2f} | {replay} | {r.tok_s:.1f} | {r.gb_s:.0f} | {r.copy_pct:.1f}% | {hf} | {ratio} |"
        )
    lines.append(f"\nmeasured device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    routed = [r for r in results if r.experts_read]
    if routed:
        lines.append(
            "MoE bytes/step count only the routed experts read: distinct experts per layer, measured from the "
            "routers in one eager step after each case: "
            + ", ".join(
                f"{r.prompt}x{r.batch} {r.label or ('graph' if r.graph else 'eager')} {r.experts_read:.1f}"
                for r in routed
            )
        )
    return "\n".join(lines)


def matmul_peak_tflops(device: str, n: int = 8192, reps: int = 10) -> float:
    """bf16 matrix product rate on random data (the prefill ceiling), median of ``reps``."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * n**3 / (sorted(times)[reps // 2] * 1e-3) / 1e12


def prefill_flops(model: Model, tokens: int) -> tuple[float, bool]:
    """(FLOPs, attention counted) of a prefill of ``tokens`` tokens: 2 x the matrix elements a token multiplies
    (routed experts: their top-k share of each stack) x tokens, plus causal attention (QK^T and PV over half the
    square) for a model whose every layer is full attention over ``cfg``'s heads; a hybrid or windowed model
    counts the matrices only."""
    from dgpp.bench.models import weight_bytes_per_step
    from dgpp.bench.step_bytes import moe_layers

    params = logical_weight_elements(model, weight_bytes_per_step(model))  # packed linears: out x in each
    for moe in moe_layers(model):  # a token multiplies top_k of the stack's experts, not all of them
        stack = expert_elements(moe.experts)  # logical elements: a packed stack stores fewer
        params -= round(stack * (1 - moe.gate.cfg.top_k / moe.experts.num_experts))
    cfg = getattr(model, "cfg", None)
    full_attention = (
        not model.info.hybrid
        and all(hasattr(cfg, key) for key in ("num_layers", "num_heads", "head_dim"))
        and set(getattr(cfg, "layer_types", None) or ()) <= {"full_attention"}
    )
    attn = (
        2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens / 2 if full_attention else 0.0
    )
    return 2 * params * tokens + attn, full_attention


def warm_prefill_session(
    model: Model, tokens: int, seed: int = 0, kv_dtype: str = "auto"
) -> tuple[DecodeSession, list[list[int]]]:
    """An eager one-sequence session and a random prompt of ``tokens`` tokens, prefilled once (compiles and
    allocations done): what a timed or profiled prefill of the same prompt runs after."""
    session = DecodeSession(model, 1, tokens + 1, 16, graph=False, kv_dtype=kv_dtype)
    prompt = random_prompts(1, tokens, model.info.vocab_size, seed)
    session.prefill(prompt)
    return session, prompt


def prefill_tflops(
    model: Model, tokens: int, seed: int = 0, kv_dtype: str = "auto"
) -> tuple[float, float, bool]:
    """(seconds, TFLOP/s, attention counted) of one eager prefill of ``tokens`` tokens (one step, K/V written as
    ``kv_dtype`` stores them); FLOPs as ``prefill_flops`` counts them."""
    session, prompt = warm_prefill_session(model, tokens, seed, kv_dtype)
    _sync()
    t0 = time.perf_counter()
    session.prefill(prompt)
    _sync()
    seconds = time.perf_counter() - t0
    flops, with_attention = prefill_flops(model, tokens)
    return seconds, flops / seconds / 1e12, with_attention
