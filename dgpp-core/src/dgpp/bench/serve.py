"""``dgpp bench serve``: what a user gets over HTTP, next to what the engine decodes in-process.

Writes a random-weight checkpoint of a real geometry to disk (``dgpp.bench.checkpoint``), times ``dgpp bench``'s
graph decode of that geometry at each case's batch, then starts a real ``dgpp serve`` on the checkpoint and drives
it with N concurrent clients per case (all sent at once: the burst is part of the measure):

    dgpp bench serve --geometry qwen3-8b --serve-cases 1,8,64,64:sampled,64:nostream
    dgpp bench serve --quant fp8_block ...   # the checkpoint packed in that release's layout (one format)
    dgpp bench serve --solo-check 24 ...     # also: 24 greedy prompts alone, then at once, must give equal texts

A case is ``N[:sampled][:nostream]`` (sampled = temperature 0.8, top-p 0.95, top-k 50). Each client streams
``/v1/completions`` for ``--max-tokens`` tokens (ignore_eos) from its own ``--prompt-tokens``-token prompt. Per case:
wall tok/s (all tokens / first send to last token), steady tok/s (tokens while every stream is decoding), TTFT and
inter-token latency p50 / p99, and the in-process decode rate at the same batch with the ratio steady / bench.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dgpp.bench.provenance import tree_commit
from dgpp.errors import ConfigError

SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}


@dataclass
class Case:
    streams: int
    sampled: bool = False
    stream: bool = True

    @property
    def label(self) -> str:
        return (
            f"{self.streams}"
            + (", T 0.8 top-p 0.95 top-k 50" if self.sampled else "")
            + ("" if self.stream else ", non-streaming")
        )


@dataclass
class StreamTimes:
    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    done: float = 0.0


def parse_serve_cases(text: str) -> list[Case]:
    cases = []
    for item in filter(None, text.split(",")):
        head, *flags = item.split(":")
        unknown = set(flags) - {"sampled", "nostream"}
        if unknown:
            raise ValueError(f"--serve-cases: unknown flag(s) {sorted(unknown)} in {item!r}")
        cases.append(Case(int(head), "sampled" in flags, "nostream" not in flags))
    return cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _one(client, url: str, body: dict, times: StreamTimes) -> None:
    if not body["stream"]:
        r = await client.post(url, json=body)
        r.raise_for_status()
        times.done = time.perf_counter()
        times.tokens = r.json()["usage"]["completion_tokens"]
        return
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                times.tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                times.chunks.append(time.perf_counter())
    times.done = time.perf_counter()


def _client(requests: int):
    """An async HTTP client with room for ``requests`` requests at once (and no log line per request)."""
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    return httpx.AsyncClient(timeout=600.0, limits=limits)


async def drive(base: str, case: Case, prompts: list[str], max_tokens: int) -> list[StreamTimes]:
    async with _client(case.streams) as client:
        times = []
        tasks = []
        for i in range(case.streams):
            body = {
                "model": "bench",
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": case.stream,
                **(SAMPLED if case.sampled else {"temperature": 0.0}),
            }
            if case.sampled:
                body["seed"] = i
            if case.stream:
                body["stream_options"] = {"include_usage": True}
            times.append(StreamTimes(sent=time.perf_counter()))
            tasks.append(_one(client, f"{base}/v1/completions", body, times[-1]))
        await asyncio.gather(*tasks)
    return times


async def greedy_texts(base: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion (ignore_eos, not streamed), all sent at once."""
    async with _client(len(prompts)) as client:

        async def one(prompt: str) -> str:
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
            r = await client.post(f"{base}/v1/completions", json={**body, "temperature": 0.0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def solo_equals_batched(base: str, prompts: list[str], max_tokens: int) -> tuple[int, int]:
    """(prompts whose greedy text is the same sent alone and among all of them at once, prompts)."""
    alone = [asyncio.run(greedy_texts(base, [p], max_tokens))[0] for p in prompts]
    together = asyncio.run(greedy_texts(base, prompts, max_tokens))
    return sum(a == b for a, b in zip(alone, together, strict=True)), len(prompts)


async def staggered(base: str, case: Case, prompts: list[str], first: int = 4) -> None:
    """A burst whose first ``first`` requests arrive ahead of the rest: they are admitted alone and are decoding
    when the others arrive, so the others' prefill shares a step with decode rows. A warm-up: that step mix runs
    kernel variants (prefill tile classes, the decode attention of decode rows beside prefill chunks) a burst
    admitted at once never does, and the first run of each variant compiles it."""
    early = asyncio.ensure_future(drive(base, Case(first, case.sampled), prompts[:first], 32))
    await asyncio.sleep(0.1)
    await drive(base, Case(len(prompts) - first, case.sampled), prompts[first:], 8)
    await early


def summarize(case: Case, times: list[StreamTimes]) -> dict[str, float]:
    start = min(t.sent for t in times)
    end = max(t.done for t in times)
    tokens = sum(t.tokens for t in times)
    out = {"wall_tok_s": tokens / (end - start)}
    if not case.stream:
        return out
    firsts = [t.chunks[0] for t in times if t.chunks]
    lasts = [t.chunks[-1] for t in times if t.chunks]
    ttft = [(t.chunks[0] - t.sent) * 1e3 for t in times if t.chunks]
    itl = [(b - a) * 1e3 for t in times for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    lo, hi = max(firsts), min(lasts)  # every stream decoding
    inside = sum(1 for t in times for c in t.chunks if lo < c <= hi)
    out.update(
        steady_tok_s=inside / (hi - lo) if hi > lo else float("nan"),
        ttft_p50=_pct(ttft, 0.5),
        ttft_p99=_pct(ttft, 0.99),
        itl_p50=_pct(itl, 0.5),
        itl_p99=_pct(itl, 0.99),
    )
    return out


def bench_decode_rates(
    geometry: str, batches: set[int], prompt: int, new: int, device: str, quant: str = ""
) -> dict[int, float]:
    """``dgpp bench``'s graph decode tok/s of ``geometry`` at each batch (model freed afterwards); ``quant``: its
    linears packed in that format, and the packed decode kernel the server's engine resolves (``auto`` for steps
    of the widest case's rows)."""
    from dgpp.bench.decode import copy_bandwidth_gbs, run_case
    from dgpp.bench.models import build_pair, hf_config, packed_release
    from dgpp.policy import overriding

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, _ = build_pair(geometry, device, dtype, with_hf=False)
    if quant:
        from dgpp.bench.quantize import quantize_model

        model = quantize_model(model, hf_config(geometry, dtype), quant, packed_release(geometry))
    copy_gbs = copy_bandwidth_gbs(device) if device == "cuda" else 1.0
    with overriding(quant_decode_gemv="auto", decode_max_rows=max(batches)):
        rates = {
            b: run_case(model, prompt, b, new, graph=True, copy_gbs=copy_gbs).tok_s for b in sorted(batches)
        }
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rates


def _server(
    checkpoint: Path, workdir: Path, engine: dict, pythonpath: str | None
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cfg = workdir / "deploy.json"
    cfg.write_text(
        json.dumps(
            {"model": str(checkpoint), "http": {"bind_host": "127.0.0.1", "port": port}, "engine": engine}
        )
    )
    env = dict(os.environ)
    if pythonpath:  # serve another checkout's code (the before of a before/after)
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    log = open(workdir / "server.log", "w")  # noqa: SIM115 - lives as long as the server
    cmd = [sys.executable, "-c", "import sys; from dgpp.cli import main; sys.exit(main())", "serve", str(cfg)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), f"http://127.0.0.1:{port}"


def _wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dgpp serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"dgpp serve not ready after {timeout:.0f} s")


def _profile(pid: int, out_dir: str, case: Case, delay: float = 2.0) -> subprocess.Popen | None:
    """py-spy (when installed) samples every thread of the server for 4 s from ``delay`` s after the case's
    requests go out (the default: its decode; 0: the burst's admission and prefill too)."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("--profile-dir: py-spy is not installed; no profile", flush=True)
        return None
    out = Path(out_dir) / f"profile-{case.streams}{'-sampled' if case.sampled else ''}.txt"
    cmd = [
        exe,
        "record",
        "--pid",
        str(pid),
        "--duration",
        "4",
        "--rate",
        "200",
        "--threads",
        "--nonblocking",
        "--format",
        "raw",
        "--output",
        str(out),
    ]
    return subprocess.Popen(["bash", "-c", f'sleep {delay:g} && exec "$@"', "_", *cmd])


def serve_quant(text: str) -> str:
    """The one weight format ``dgpp bench serve --quant`` serves ("" for the dense bf16 checkpoint)."""
    from dgpp.bench.quantize import DENSE, parse_variants

    if not text.strip():
        return ""
    variants = parse_variants(text)
    if len(variants) != 1:
        raise ConfigError(f"--quant: dgpp bench serve serves one weight format at a time, got {variants}")
    return "" if variants[0] == DENSE else variants[0]


def run_serve(args) -> int:
    from dgpp.bench.checkpoint import word_prompt, write_checkpoint
    from dgpp.bench.models import hf_config

    cases = parse_serve_cases(args.serve_cases)
    vocab = int(hf_config(args.geometry, torch.float32)["vocab_size"])
    t0 = time.perf_counter()
    root = Path(args.checkpoint_dir or tempfile.mkdtemp(prefix="dgpp-bench-serve-"))
    quant = serve_quant(args.quant)
    checkpoint = write_checkpoint(
        args.geometry,
        root / (f"{args.geometry}-{quant}" if quant else args.geometry),
        args.device,
        torch.bfloat16 if args.device == "cuda" else torch.float32,
        quant=quant,
    )
    print(f"checkpoint {checkpoint} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    rates = (
        {}
        if args.no_bench
        else bench_decode_rates(
            args.geometry, {c.streams for c in cases}, args.prompt_tokens, args.max_tokens, args.device, quant
        )
    )
    width = max([c.streams for c in cases] + [args.solo_check])
    engine = {
        "max_concurrency": width,
        "kv_capacity": width * (args.prompt_tokens + args.max_tokens + 64),
        "queue_limit": 4 * width,
        "max_connections": 4 * width + 8,
        "default_max_tokens": args.max_tokens,
        "model_alias": "bench",
        **json.loads(args.engine or "{}"),
    }
    workdir = Path(tempfile.mkdtemp(prefix="dgpp-bench-serve-run-"))
    proc, base = _server(checkpoint, workdir, engine, args.server_pythonpath)
    rows = []
    same: tuple[int, int] | None = None
    try:
        _wait_ready(proc, base, workdir / "server.log")
        warm = [word_prompt(args.prompt_tokens, vocab, 10_000 + i) for i in range(width)]
        asyncio.run(drive(base, Case(width), warm, 8))  # graphs captured, prefill shapes compiled
        if width > 4:  # a burst admitted over two ticks: the step mix of decode rows beside prefill chunks
            asyncio.run(
                staggered(
                    base,
                    Case(width),
                    [word_prompt(args.prompt_tokens, vocab, 20_000 + i) for i in range(width)],
                )
            )
        if any(c.sampled for c in cases):  # the sampling kernels compiled before a sampled case's burst
            asyncio.run(drive(base, Case(width, sampled=True), warm, 8))
        if args.solo_check:  # after the warm-up: every batch shape compiled, graphs captured
            solo = [word_prompt(args.prompt_tokens, vocab, 30_000 + i) for i in range(args.solo_check)]
            same = solo_equals_batched(base, solo, args.max_tokens)
            print(f"greedy solo == batched: {same[0]} of {same[1]} prompts equal", flush=True)
        for n, case in enumerate(cases):
            prompts = [word_prompt(args.prompt_tokens, vocab, 1000 * n + i) for i in range(case.streams)]
            spy = (
                _profile(proc.pid, args.profile_dir, case, args.profile_delay)
                if args.profile_dir and case.stream
                else None
            )
            stats = summarize(case, asyncio.run(drive(base, case, prompts, args.max_tokens)))
            if spy is not None:
                spy.wait()
            bench = rates.get(case.streams)
            ratio = stats.get("steady_tok_s", stats["wall_tok_s"]) / bench if bench else float("nan")
            rows.append((case, stats, bench, ratio))
            print(
                f"{case.label}: {json.dumps({k: round(v, 1) for k, v in stats.items()})}, bench "
                f"{bench or float('nan'):.0f} tok/s",
                flush=True,
            )
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print("\n" + header(args, engine) + "\n\n" + format_rows(rows))
    if same is not None:
        print(
            f"\ngreedy solo == batched over {same[1]} prompts ({args.max_tokens} tokens each): "
            f"{same[0] == same[1]} ({same[0]} of {same[1]} equal)"
        )
        return 0 if same[0] == same[1] else 1
    return 0


def header(args, engine: dict) -> str:
    commit = tree_commit()
    return (
        f"date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, "
        f"commit {commit or 'unknown'}, geometry {args.geometry} {'bf16' if args.device == 'cuda' else 'fp32'} random weights"
        f"{f' packed as {args.quant}' if args.quant.strip() else ''}, {args.prompt_tokens}-token "
        f"prompts, {args.max_tokens} tokens out (ignore_eos), engine {json.dumps(engine)}"
    )


def format_rows(rows: list) -> str:
    lines = [
        "| streams | wall tok/s | steady tok/s | bench tok/s | steady / bench | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, s, bench, ratio in rows:
        ttft = f"{s['ttft_p50']:.0f} / {s['ttft_p99']:.0f}" if "ttft_p50" in s else "—"
        itl = f"{s['itl_p50']:.1f} / {s['itl_p99']:.1f}" if "itl_p50" in s else "—"
        steady = f"{s['steady_tok_s']:,.0f}" if "steady_tok_s" in s else "—"
        lines.append(
            f"| {case.label} | {s['wall_tok_s']:,.0f} | {steady} | "
            f"{f'{bench:,.0f}' if bench else '—'} | {ratio:.0%} | {ttft} | {itl} |"
        )
    return "\n".join(lines)
