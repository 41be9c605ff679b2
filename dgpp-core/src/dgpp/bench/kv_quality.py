"""``dgpp bench kv-quality``: what ``engine.kv_dtype: fp8`` (and, for MLA latents, ``fp4``) costs against the exact
chain, on the CPU.

    dgpp bench kv-quality [--model dgpp-demo/smollm2-135m-instruct] [--dtype float32] [--runs 3]
                          [--new-tokens 32] [--fixtures] [--out FILE]

On a real model (default: the demo's SmolLM2-135M-Instruct, fetched as ``dgpp serve`` fetches it) and the fixed
text set ``dgpp.bench.kv_quality_texts``, each chain prefills the texts together in one step and scores every
row (teacher-forced): mean NLL per token and the rows whose argmax equals the exact chain's. Each text's first half
is then continued greedily for ``--new-tokens`` tokens (the texts batched): the tokens produced before the first one that differs
from the exact chain's. The exact chain runs ``--runs`` times plus once in 16-token prefill chunks: the spread of
its NLL over those runs is the run-to-run band a lossy lever's cost is compared with. ``--fixtures`` adds, for
every installed tiny checkpoint (fp32), the largest and mean logit error of the fp8 and fp4 chains against the exact
one (relative to the exact chain's largest |logit|), or "refused" where the model's caches do not read the format.
``--geometries`` adds, for every offered bench geometry (bf16, built on ``meta`` at 1, 2 and 4 ranks), the paged
K/V bytes per token (bf16, fp8, fp4) and the per-request state bytes (sliding rings) with and without fp8. Prints markdown; ``--out`` also writes it with
the date, host and commit. ``--model ""`` skips the model (the other sections alone).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dgpp.bench.kv_quality_texts import TEXTS
from dgpp.bench.provenance import tree_commit
from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.offline import engine_all_logits, greedy_generate, make_prompts
from dgpp.policy import overriding
from dgpp.step.model import Model

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
    rows = engine_all_logits(model, texts, chunk_size=chunk, kv_dtype=kv_dtype)
    total, count, agree = 0.0, 0, 0
    for ids, logits, exact in zip(texts, rows, exact_rows, strict=True):
        nll, n = _nll(logits, ids)
        total, count = total + nll, count + n
        agree += int((logits.argmax(-1) == exact.argmax(-1)).sum())
    ours = _greedy(model, texts, new_tokens, kv_dtype)
    same = sum(_same_prefix(a, b) for a, b in zip(ours, exact_greedy, strict=True))
    return ChainScore(total / count, agree, sum(len(ids) for ids in texts), same, new_tokens * len(texts))


@dataclass(frozen=True)
class LossyChain:
    """A lossy chain scored against the exact one: its K/V format and its ``dgpp.policy`` switches."""

    name: str
    kv_dtype: str = "auto"
    policy: tuple[tuple[str, object], ...] = ()


KV_FP8 = LossyChain("kv_dtype fp8", kv_dtype="fp8")


def measure_model(
    model: Model,
    texts: list[list[int]],
    runs: int,
    new_tokens: int,
    lossy: tuple[LossyChain, ...] = (KV_FP8,),
    base: str = "exact",
) -> Iterator[str]:
    """The markdown rows for one model, each as it is measured: the ``base`` chain's runs (the exact chain, or the
    chain a lever is compared with), each lossy chain, the band."""
    exact_rows = engine_all_logits(model, texts)
    exact_greedy = _greedy(model, texts, new_tokens, "auto")
    exact_chains = [LossyChain(f"{base}, run {r + 1}") for r in range(runs)]
    chunked = LossyChain(f"{base}, {BAND_CHUNK}-token prefill chunks")
    chains = [(c, None) for c in exact_chains] + [(chunked, BAND_CHUNK)] + [(c, None) for c in lossy]
    yield f"| chain | NLL / token | Δ NLL vs {base} run 1 | argmax rows = {base} | greedy tokens = {base} |"
    yield "|---|---|---|---|---|"
    scores = []
    for chain, chunk in chains:
        with overriding(**dict(chain.policy)):
            s = score_chain(model, texts, chain.kv_dtype, exact_rows, exact_greedy, new_tokens, chunk)
        scores.append(s)
        yield (
            f"| {chain.name} | {s.nll:.6f} | {s.nll - scores[0].nll:+.6f} | {s.top1_agree}/{s.rows} "
            f"| {s.greedy_same}/{s.greedy_total} |"
        )
    exact = scores[: runs + 1]
    band = max(s.nll for s in exact) - min(s.nll for s in exact)
    yield ""
    yield f"run-to-run band of the {base} chain (NLL max - min over {len(exact)} runs): {band:.6f}"
    for chain, s in zip(lossy, scores[runs + 1 :], strict=True):
        inside = abs(s.nll - exact[0].nll) <= band
        yield f"{chain.name} cost {s.nll - exact[0].nll:+.6f} is {'inside' if inside else 'outside'} it"


def fixture_errors() -> Iterator[str]:
    """For every installed tiny checkpoint (fp32): the largest and mean logit error of the fp8 and fp4 chains against
    the exact chain, relative to its largest |logit| (a format the model's caches do not read: refused)."""
    from dgpp.catalog import tiny_checkpoints
    from dgpp.startup.loading import load_model

    yield from [
        "| tiny checkpoint | fp8 largest | fp8 mean | fp4 largest | fp4 mean |",
        "|---|---|---|---|---|",
    ]
    for kind, offer in sorted(tiny_checkpoints().items()):
        cells = []
        with tempfile.TemporaryDirectory() as tmp:
            model = load_model(offer.build(tmp, seed=0))
            prompts = make_prompts(model.info.vocab_size, FIXTURE_LENGTHS, seed=2)
            exact = torch.cat(engine_all_logits(model, prompts))
            scale = float(exact.abs().max())
            for kv in ("fp8", "fp4"):
                try:
                    diff = (torch.cat(engine_all_logits(model, prompts, kv_dtype=kv)) - exact).abs()
                except ConfigError:
                    cells += ["refused", ""]
                    continue
                cells += [f"{float(diff.max()) / scale:.2e}", f"{float(diff.mean()) / scale:.2e}"]
        yield f"| {kind} | {' | '.join(cells)} |"


def geometry_rates(world_sizes: tuple[int, ...] = (1, 2, 4)) -> Iterator[str]:
    """Per offered bench geometry and world size: (paged K/V bytes per token, state bytes per request) on one rank,
    bf16 and fp8, from the cache entries its model declares when built on ``meta``."""
    from dgpp.bench.models import hf_config
    from dgpp.catalog import bench_geometries
    from dgpp.family import LoadContext, World
    from dgpp.plugins import manager, resolve
    from dgpp.step.cache_spec import stored_as
    from dgpp.step.memory import cache_rates

    pm = manager()
    yield "| geometry | ranks | K/V B/token bf16 | fp8 | fp4 | state B/request bf16 | fp8 |"
    yield "|---|---|---|---|---|---|---|"
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
            try:
                kv4 = f"{cache_rates(stored_as(spec, 'fp4'))[0]:,}"
            except ConfigError:
                kv4 = "refused"
            yield f"| {name} | {size} | {kv:,} | {kv8} | {kv4} | {state:,} | {state8} |"


def load_scored(
    model_id: str, dtype: str, engine: EngineConfig | None = None
) -> tuple[Model, list[list[int]]]:
    """The model (loaded under ``engine``'s keys) and the text set tokenized."""
    from dgpp.checkpoint.resolve import resolve_checkpoint
    from dgpp.startup.loading import load_model
    from dgpp.text.tokenizer import Tokenizer

    checkpoint = resolve_checkpoint(model_id)
    model = load_model(checkpoint, engine or EngineConfig(), dtype=getattr(torch, dtype))
    tokenizer = Tokenizer.from_dir(checkpoint)
    return model, [tokenizer.encode(text) for text in TEXTS]


def _sections(args: argparse.Namespace) -> Iterator[str]:
    if args.model:
        model, texts = load_scored(args.model, args.dtype)
        yield (
            f"## engine.kv_dtype fp8 on {args.model} ({args.dtype}), {len(texts)} texts, "
            f"{sum(len(t) for t in texts)} tokens"
        )
        yield ""
        yield from measure_model(model, texts, args.runs, args.new_tokens)
    if args.geometries:
        yield from ["", "## K/V bytes per rank with and without fp8 / fp4, bench geometries (bf16)", ""]
        yield from geometry_rates()
    if args.fixtures:
        yield from ["", "## fp8 / fp4 logit error against the exact chain, tiny fp32 checkpoints", ""]
        yield from fixture_errors()


def run_kv_quality(args: argparse.Namespace) -> int:
    return print_report(_sections(args), args.out)


def print_report(sections: Iterator[str], out: str) -> int:
    """Print each line as it is measured; ``out``: also write them, after the date, host and commit."""
    torch.manual_seed(0)
    lines = []
    for line in sections:
        print(line, flush=True)
        lines.append(line)
    if out:
        commit = tree_commit()
        when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
        with open(out, "w") as f:
            f.write(f"{when}, {platform.processor() or platform.machine()}, commit {commit}\n\n")
            f.write("\n".join(lines) + "\n")
    return 0
