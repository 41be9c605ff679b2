"""Single-stream CPU decode: ``dgpp serve`` on the demo's SmolLM2-135M-Instruct GGUF against transformers'
``generate`` on the same file, in one run (docs/benchmarks.md, "CPU decode").

    python tests/perf/bench_cpu_serve.py [--tokens 256] [--dtypes float32,bfloat16] [--cpu-threads 0]
                                         [--gguf-weights decoded,int4pack] [--no-transformers]

dgpp: one streaming chat request with ``ignore_eos``; the rate is (completion tokens - 1) over the time
from the first to the last streamed chunk (decode only, as a client sees it); the server takes
``engine.cpu_threads`` from ``--cpu-threads`` (0: its default, one per core less one), and one run per value of
``--gguf-weights`` (``engine.gguf_weights``; ``int4pack``: the GGUF's blocks multiplied packed). transformers: greedy
``generate`` with ``min_new_tokens`` = ``max_new_tokens``; the rate is (N - 1) over the time of N tokens
minus the time of one (its prefill), on all cores torch is given (``torch.get_num_threads()``).
llama.cpp (when ``llama_cpp`` is importable): the same GGUF as shipped (its packed Q4_1/Q8_0 weights),
greedy, the same chat-rendered prompt ids, on as many threads; the rate is (N - 1) over the time from
the first to the N-th generated token.
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


def chat_ids(gguf: Path) -> list[int]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True
    )
    return list(ids["input_ids"])


def llama_cpp_rate(gguf: Path, tokens: int) -> float | None:
    """llama.cpp's decode rate on the GGUF as shipped, or None when ``llama_cpp`` is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)
    stamps = []
    for _ in llm.generate(chat_ids(gguf), temp=0.0, top_k=1, reset=True):  # EOS does not stop generate()
        stamps.append(time.perf_counter())
        if len(stamps) == tokens:
            break
    return (tokens - 1) / (stamps[-1] - stamps[0])


def dgpp_rate(
    dtype: str, tokens: int, workdir: Path, cpu_threads: int = 0, gguf_weights: str = "decoded"
) -> float:
    from openai import OpenAI
    from serve_fixture import running

    template = json.loads((REPO / "deploy" / "demo_cpu.json").read_text())
    engine = {
        **template["engine"],
        "dtype": dtype,
        "max_concurrency": 1,
        "cpu_threads": cpu_threads,
        "gguf_weights": gguf_weights,
    }
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

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype)
    ).eval()
    prompt = torch.tensor([chat_ids(gguf)])

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
    parser.add_argument(
        "--cpu-threads", type=int, default=0, help="dgpp's engine.cpu_threads (0: its default)"
    )
    parser.add_argument(
        "--gguf-weights", default="decoded", help="engine.gguf_weights values, comma-separated"
    )
    parser.add_argument("--no-transformers", action="store_true", help="dgpp (and llama.cpp) only")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dgpp-bench-cpu"))
    args = parser.parse_args()
    gguf = demo_gguf()
    print(f"torch threads {torch.get_num_threads()}, {args.tokens} new tokens, prompt {PROMPT!r}")
    print("| weights | gguf_weights | dgpp serve | transformers generate | dgpp / transformers |")
    print("|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        theirs = None if args.no_transformers else transformers_rate(gguf, dtype, args.tokens)
        for gguf_weights in args.gguf_weights.split(","):
            ours = dgpp_rate(dtype, args.tokens, args.workdir / dtype, args.cpu_threads, gguf_weights)
            ratio = "" if theirs is None else f"{ours / theirs:.2f}x"
            print(
                f"| {dtype} | {gguf_weights} | {ours:.1f} tok/s | {'' if theirs is None else f'{theirs:.1f} tok/s'} "
                f"| {ratio} |"
            )
    packed = llama_cpp_rate(gguf, args.tokens)
    if packed is None:
        print("llama.cpp: llama_cpp not importable (pip install llama-cpp-python), not measured")
    else:
        print(f"| GGUF as shipped (Q4_1/Q8_0) | | llama.cpp {packed:.1f} tok/s | | |")


if __name__ == "__main__":
    main()
