"""Single-stream CPU decode: ``dgpp serve`` on the demo's SmolLM2-135M-Instruct GGUF against transformers'
``generate`` on the same file, in one run (docs/benchmarks.md, "CPU decode").

    python tests/perf/bench_cpu_serve.py [--tokens 256] [--dtypes float32,bfloat16]

dgpp: one streaming chat request with ``ignore_eos``; the rate is (completion tokens - 1) over the time
from the first to the last streamed chunk (decode only, as a client sees it). transformers: greedy
``generate`` with ``min_new_tokens`` = ``max_new_tokens``; the rate is (N - 1) over the time of N tokens
minus the time of one (its prefill). Both use all cores torch is given (``torch.get_num_threads()``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
PROMPT = "Write a long story about a dragon who learns to bake bread."


def demo_gguf() -> Path:
    from dgpp.checkpoint.gguf_convert import ensure_converted, find_gguf
    from dgpp.demo import ensure_demo_checkpoint

    model = json.loads((REPO / "deploy" / "demo_cpu.json").read_text())["model"]
    path = find_gguf(ensure_demo_checkpoint(model))
    ensure_converted(path)
    return path


def dgpp_rate(dtype: str, tokens: int, workdir: Path) -> float:
    from openai import OpenAI
    from serve_fixture import running

    template = json.loads((REPO / "deploy" / "demo_cpu.json").read_text())
    engine = {**template["engine"], "dtype": dtype, "max_concurrency": 1}
    workdir.mkdir(parents=True, exist_ok=True)
    with running(template["model"], workdir, engine) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        stamps, usage = [], None
        stream = client.chat.completions.create(
            model="dgpp-demo",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
    assert usage is not None and usage.completion_tokens == tokens, usage
    return (tokens - 1) / (stamps[-1] - stamps[0])


def transformers_rate(gguf: Path, dtype: str, tokens: int) -> float:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
    ).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )
    prompt = torch.tensor([ids["input_ids"]])

    def timed(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        assert out.shape[1] == prompt.shape[1] + n
        return time.perf_counter() - start

    timed(2)  # warm-up
    return (tokens - 1) / (timed(tokens) - timed(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dgpp-bench-cpu"))
    args = parser.parse_args()
    gguf = demo_gguf()
    print(f"torch threads {torch.get_num_threads()}, {args.tokens} new tokens, prompt {PROMPT!r}")
    for dtype in args.dtypes.split(","):
        ours = dgpp_rate(dtype, args.tokens, args.workdir / dtype)
        theirs = transformers_rate(gguf, dtype, args.tokens)
        print(
            f"| {dtype} | dgpp serve {ours:.1f} tok/s | transformers generate {theirs:.1f} tok/s | {ours / theirs:.2f}x |"
        )


if __name__ == "__main__":
    main()
