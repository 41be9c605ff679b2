"""Prompt-lookup drafts on the CPU demo: ``dgpp serve`` on SmolLM2-135M-Instruct with ``engine.draft: "lookup"``
against the same deployment decoding plainly, on the copy-heavy prompts of tests/perf/lookup_prompts.json
(docs/benchmarks.md, "Prompt-lookup drafts").

    python tests/perf/bench_lookup_drafts.py [--tokens 160] [--repeats 3] [--depth 3] [--ngram 3] [--min-ngram 2]

Both servers run side by side (one request at a time, the two alternating, so a busy machine slows both alike).
Each request is a greedy streaming chat completion; its rate is (completion tokens - 1) over the time from the
first to the last streamed chunk. The outputs of the two servers must be identical, token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
PROMPTS = json.loads((REPO / "tests" / "perf" / "lookup_prompts.json").read_text())


def timed_chat(client, prompt: str, tokens: int) -> tuple[str, int, float]:
    """(text, completion tokens, decode tok/s) of one greedy streaming request."""
    stamps, usage, parts = [], None, []
    stream = client.chat.completions.create(
        model="dgpp-demo",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    assert usage is not None and len(stamps) > 1
    return "".join(parts), usage.completion_tokens, (usage.completion_tokens - 1) / (stamps[-1] - stamps[0])


def main() -> None:
    from contextlib import ExitStack

    from openai import OpenAI
    from serve_fixture import running

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--min-ngram", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dgpp-bench-lookup"))
    args = parser.parse_args()
    template = json.loads((REPO / "deploy" / "demo_cpu.json").read_text())
    base = {**template["engine"], "max_concurrency": 1, "prefix_cache_gib": 0}
    engines = {
        "plain": base,
        "lookup": {
            **base,
            "draft": "lookup",
            "draft_depth": args.depth,
            "lookup_ngram": args.ngram,
            "lookup_min_ngram": args.min_ngram,
        },
    }
    rates: dict[str, list[list[float]]] = {name: [[] for _ in PROMPTS] for name in engines}
    with ExitStack() as stack:
        clients = {}
        for name, engine in engines.items():
            (args.workdir / name).mkdir(parents=True, exist_ok=True)
            server = stack.enter_context(running(template["model"], args.workdir / name, engine))
            clients[name] = OpenAI(base_url=server.url + "/v1", api_key="unused")
        for rep in range(args.repeats):
            for i, prompt in enumerate(PROMPTS):
                texts = {}
                order = list(engines) if rep % 2 == 0 else list(reversed(engines))
                for name in order:
                    text, n, rate = timed_chat(clients[name], prompt, args.tokens)
                    texts[name] = (text, n)
                    rates[name][i].append(rate)
                assert texts["plain"] == texts["lookup"], f"prompt {i}: outputs differ"
        import httpx

        spec = httpx.get(stack_url(clients["lookup"]) + "/metrics", timeout=10).json()["scheduler"][
            "spec_decode"
        ]
    print(
        f"{args.tokens} max tokens, {args.repeats} runs each, depth {args.depth}, ngram {args.min_ngram}..{args.ngram}; "
        "outputs identical"
    )
    print("| prompt | plain tok/s (median, min-max) | lookup tok/s (median, min-max) | speed-up (median) |")
    print("|---|---|---|---|")
    ratios = []
    for i in range(len(PROMPTS)):
        p, q = rates["plain"][i], rates["lookup"][i]
        ratios.append(statistics.median(q) / statistics.median(p))
        print(
            f"| {i} | {statistics.median(p):.1f} ({min(p):.1f}-{max(p):.1f}) | "
            f"{statistics.median(q):.1f} ({min(q):.1f}-{max(q):.1f}) | {ratios[-1]:.2f}x |"
        )
    print(
        f"geometric mean speed-up {statistics.geometric_mean(ratios):.2f}x; acceptance "
        f"{spec['num_accepted_tokens_total']}/{spec['num_draft_tokens_total']} draft tokens"
    )


def stack_url(client) -> str:
    return str(client.base_url).removesuffix("/v1/").removesuffix("/v1")


if __name__ == "__main__":
    main()
