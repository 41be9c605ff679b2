"""``dgpp bench kv-quality``: what ``engine.kv_dtype: fp8`` costs against the exact chain, on the CPU.

    dgpp bench kv-quality [--model dgpp-demo/smollm2-135m-instruct] [--dtype float32] [--runs 3]
                          [--new-tokens 32] [--fixtures] [--out FILE]

On a real model (default: the demo's SmolLM2-135M-Instruct, fetched as ``dgpp serve`` fetches it) and the fixed
text set ``dgpp.bench.kv_quality_texts``, each chain prefills the texts together in one step and scores every
row (teacher-forced): mean NLL per token and the rows whose argmax equals the exact chain's. Each text's first half
is then continued greedily for ``--new-tokens`` tokens (the texts batched): the tokens produced before the first one that differs
from the exact chain's. The exact chain runs ``--runs`` times plus once in 16-token prefill chunks: the spread of
its NLL over those runs is the run-to-run band a lossy lever's cost is compared with. ``--fixtures`` adds, for
every installed tiny checkpoint (fp32), the largest logit error of the fp8 chain against the exact one (relative
to the exact chain's largest |logit|), or why the lever is refused there. ``--geometries`` adds, for every
offered bench geometry (bf16, built on ``meta`` at 1, 2 and 4 ranks), the paged K/V bytes per token and the
per-request state bytes (sliding rings) with and without the lever. Prints markdown; ``--out`` also writes it with
the date, host and commit.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dgpp.bench.kv_quality_texts import TEXTS
from dgpp.errors import ConfigError
from dgpp.step.model import Model
from dgpp.testing import conformance as conf
from dgpp.testing.generate import greedy_generate

BAND_CHUNK = 16  # the band's chunked run: the default chain cut in 16-token prefill steps
FIXTURE_LENGTHS = (11, 23, 4, 1)


@dataclass(frozen=True)
class ChainScore:
    """One chain over the text set: token-weighted mean NLL, teacher-forced argmax rows equal to the exact
    chain's, and greedy tokens before the first divergence from the exact chain (summed over texts)."""

    nll: float
    top1_agree: int
    rows: int
    greedy_same: int
    greedy_total: int


def _nll(logits: torch.Tensor, ids: list[int]) -> tuple[float, int]:
    """Summed NLL of ``ids[1:]`` under rows ``0..n-2`` (fp64) and the number of scored tokens."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    target = torch.tensor(ids[1:])
    return float(-logp.gather(1, target[:, None]).sum()), len(ids) - 1


def _same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _greedy(model: Model, texts: list[list[int]], new_tokens: int, kv_dtype: str) -> list[list[int]]:
    """Each text's first half continued greedily, all texts batched (a row's tokens do not depend on the batch)."""
    halves = [ids[: len(ids) // 2] for ids in texts]
    return greedy_generate(model, halves, new_tokens, stop_at_eos=False, kv_dtype=kv_dtype)


def score_chain(
    model: Model,
    texts: list[list[int]],
    kv_dtype: str,
    exact_rows: list[torch.Tensor],
    exact_greedy: list[list[int]],
    new_tokens: int,
    chunk: int | None = None,
) -> ChainScore:
    """Score ``kv_dtype`` (``engine.kv_dtype``) over the tokenized ``texts`` (prefilled together, in ``chunk``-token
    steps when given) against the exact chain's rows and greedy continuations."""
    rows = conf.engine_all_logits(model, texts, chunk_size=chunk, kv_dtype=kv_dtype)
    total, count, agree = 0.0, 0, 0
    for ids, logits, exact in zip(texts, rows, exact_rows, strict=True):
        nll, n = _nll(logits, ids)
        total, count = total + nll, count + n
        agree += int((logits.argmax(-1) == exact.argmax(-1)).sum())
    ours = _greedy(model, texts, new_tokens, kv_dtype)
    same = sum(_same_prefix(a, b) for a, b in zip(ours, exact_greedy, strict=True))
    return ChainScore(total / count, agree, sum(len(ids) for ids in texts), same, new_tokens * len(texts))


def measure_model(model: Model, texts: list[list[int]], runs: int, new_tokens: int) -> list[str]:
    """The markdown rows for one model: the exact chain's runs, its band, and the fp8 chain."""
    exact_rows = conf.engine_all_logits(model, texts)
    exact_greedy = _greedy(model, texts, new_tokens, "auto")
    chains = [(f"exact, run {r + 1}", "auto", None) for r in range(runs)]
    chains.append((f"exact, {BAND_CHUNK}-token prefill chunks", "auto", BAND_CHUNK))
    scores = [
        (name, score_chain(model, texts, kv, exact_rows, exact_greedy, new_tokens, chunk))
        for name, kv, chunk in chains
    ]
    band = max(s.nll for _, s in scores) - min(s.nll for _, s in scores)
    fp8 = score_chain(model, texts, "fp8", exact_rows, exact_greedy, new_tokens)
    exact_nll = scores[0][1].nll
    lines = [
        "| chain | NLL / token | Δ NLL vs exact | argmax rows = exact | greedy tokens = exact |",
        "|---|---|---|---|---|",
    ]
    for name, s in [*scores, ("kv_dtype fp8", fp8)]:
        lines.append(
            f"| {name} | {s.nll:.5f} | {s.nll - exact_nll:+.5f} | {s.top1_agree}/{s.rows} "
            f"| {s.greedy_same}/{s.greedy_total} |"
        )
    inside = abs(fp8.nll - exact_nll) <= band
    lines.append("")
    lines.append(
        f"run-to-run band of the exact chain (NLL max - min over {len(scores)} runs): {band:.5f}; "
        f"fp8 cost {fp8.nll - exact_nll:+.5f} is {'inside' if inside else 'outside'} it"
    )
    return lines


def fixture_errors() -> list[str]:
    """For every installed tiny checkpoint (fp32): the fp8 chain's largest logit error against the exact chain."""
    from dgpp.catalog import tiny_checkpoints
    from dgpp.startup.loading import load_model

    lines = [
        "| tiny checkpoint | max |Δ logit| / max |logit| | mean |Δ logit| / max |logit| |",
        "|---|---|---|",
    ]
    for kind, offer in sorted(tiny_checkpoints().items()):
        with tempfile.TemporaryDirectory() as tmp:
            model = load_model(offer.build(tmp, seed=0))
            prompts = conf.make_prompts(model.info.vocab_size, FIXTURE_LENGTHS, seed=2)
            exact = torch.cat(conf.engine_all_logits(model, prompts))
            try:
                lossy = torch.cat(conf.engine_all_logits(model, prompts, kv_dtype="fp8"))
            except ConfigError as e:
                lines.append(f"| {kind} | refused: {str(e).split(';')[0].split('entries ')[-1]} | |")
                continue
        scale = float(exact.abs().max())
        diff = (lossy - exact).abs()
        lines.append(f"| {kind} | {float(diff.max()) / scale:.2e} | {float(diff.mean()) / scale:.2e} |")
    return lines


def geometry_rates(world_sizes: tuple[int, ...] = (1, 2, 4)) -> list[str]:
    """Per offered bench geometry and world size: (paged K/V bytes per token, state bytes per request) on one rank,
    bf16 and fp8, from the cache entries its model declares when built on ``meta``."""
    from dgpp.bench.models import hf_config
    from dgpp.catalog import bench_geometries
    from dgpp.family import LoadContext, World
    from dgpp.plugins import manager, resolve
    from dgpp.step.cache_spec import stored_as
    from dgpp.step.memory import cache_rates

    pm = manager()
    lines = [
        "| geometry | ranks | K/V B/token bf16 | fp8 | state B/request bf16 | fp8 |",
        "|---|---|---|---|---|---|",
    ]
    for name in sorted(n for n in bench_geometries() if not n.startswith("tiny")):
        raw = hf_config(name, torch.bfloat16)
        found = resolve(pm, raw)
        for size in world_sizes:
            ctx = LoadContext(
                checkpoint_dir=Path(),
                hf_config=raw,
                family=found.family.name,
                architecture=found.matched,
                device="meta",
                world=World(0, size),
            )
            try:
                with torch.device("meta"):
                    spec = pm.hook.dgpp_build_model(ctx=ctx).cache_spec()
            except ValueError:  # heads that do not split over this many ranks
                continue
            kv, state = cache_rates(spec)
            try:
                kv8, state8 = (f"{n:,}" for n in cache_rates(stored_as(spec, "fp8")))
            except ConfigError:
                kv8 = state8 = "refused"
            lines.append(f"| {name} | {size} | {kv:,} | {kv8} | {state:,} | {state8} |")
    return lines


def _load(model_id: str, dtype: str) -> tuple[Model, list[list[int]]]:
    from dgpp.checkpoint.resolve import resolve_checkpoint
    from dgpp.config_schema import EngineConfig
    from dgpp.startup.loading import load_model
    from dgpp.text.tokenizer import Tokenizer

    checkpoint = resolve_checkpoint(model_id)
    model = load_model(checkpoint, EngineConfig(), dtype=getattr(torch, dtype))
    tokenizer = Tokenizer.from_dir(checkpoint)
    return model, [tokenizer.encode(text) for text in TEXTS]


def run_kv_quality(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model, texts = _load(args.model, args.dtype)
    lines = [
        f"## engine.kv_dtype fp8 on {args.model} ({args.dtype}), {len(texts)} texts, "
        f"{sum(len(t) for t in texts)} tokens",
        "",
        *measure_model(model, texts, args.runs, args.new_tokens),
    ]
    if args.geometries:
        lines += [
            "",
            "## K/V bytes per rank with and without fp8, bench geometries (bf16)",
            "",
            *geometry_rates(),
        ]
    if args.fixtures:
        lines += [
            "",
            "## fp8 logit error against the exact chain, tiny fp32 checkpoints",
            "",
            *fixture_errors(),
        ]
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        header = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, commit {commit}"
        with open(args.out, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    return 0
