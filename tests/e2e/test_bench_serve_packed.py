"""``dgpp bench serve --quant``'s checkpoint: a random-weight model written packed in the release's own layout
(``quantization_config``, codes and scale tensors under the release's names) loads packed, computes what its
dequantized weights compute in transformers, and serves over HTTP with a row's greedy tokens the same alone and
batched (real server process, real ``openai`` client)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from safetensors import safe_open
from serve_fixture import Server

from dgpp.bench.checkpoint import word_prompt, write_checkpoint
from dgpp.bench.quantize import QUANT_CONFIGS
from dgpp.bench.serve import serve_quant
from dgpp.errors import ConfigError
from dgpp.quant.checkpoints import dequantize_checkpoint
from dgpp.quant.linear import QuantLinearMethod
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference

# the tensors a release of each format ships for one linear (besides <module>.weight, the codes)
SCALES = {"fp8_block": ("weight_scale_inv",), "nvfp4": ("weight_scale", "weight_scale_2")}
VOCAB = 512  # the tiny geometry's


def _stored(ckpt) -> dict[str, torch.dtype]:
    out = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            out.update({name: handle.get_slice(name).get_dtype() for name in handle.keys()})
    return out


@pytest.mark.parametrize("quant", ["fp8_block", "nvfp4"])
def test_packed_bench_checkpoint_loads_packed_and_serves_alone_as_batched(quant, tmp_path):
    ckpt = write_checkpoint("tiny", tmp_path / "ckpt", "cpu", torch.float32, quant=quant)
    assert json.loads((ckpt / "config.json").read_text())["quantization_config"] == QUANT_CONFIGS[quant]
    stored = _stored(ckpt)
    q_proj = "model.layers.0.self_attn.q_proj"
    assert stored[f"{q_proj}.weight"] in (("F8_E4M3",) if quant == "fp8_block" else ("U8",))
    assert all(f"{q_proj}.{s}" in stored for s in SCALES[quant])
    assert stored["model.embed_tokens.weight"] == "F32" and stored["lm_head.weight"] == "F32"

    model = load_model(ckpt)
    packed = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), QuantLinearMethod)]
    assert len(packed) == 2 * 7  # q/k/v/o and gate/up/down of both decoder layers
    reference = load_reference(dequantize_checkpoint(ckpt, tmp_path / "dense"))
    assert conf.check_logits(model, reference, conf.make_prompts(VOCAB, (7, 19), seed=1), rtol=1e-4) < 1e-4
    del model, reference

    server = Server(
        ckpt,
        tmp_path,
        {"max_concurrency": 4, "kv_capacity": 256, "default_max_tokens": 8, "model_alias": "bench"},
    )
    try:
        server.wait_ready()
        assert "quantized modules" in server.log.read_text()
        sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        prompts = [word_prompt(12, VOCAB, seed) for seed in range(4)]

        def greedy(prompt: str) -> str:
            done = sdk.completions.create(
                model="bench", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            return done.choices[0].text

        alone = [greedy(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(greedy, prompts))
    finally:
        server.stop()
    assert all(alone) and together == alone


def test_bench_serve_takes_one_format():
    assert serve_quant("") == "" and serve_quant("bf16") == "" and serve_quant(" fp8_block ") == "fp8_block"
    with pytest.raises(ConfigError, match="one weight format"):
        serve_quant("fp8_block,nvfp4")
    with pytest.raises(ConfigError, match="unknown"):
        serve_quant("int3")


def test_bench_serve_solo_check_through_a_real_server(tmp_path, capsys):
    """``dgpp bench serve --solo-check N``: N greedy prompts sent one at a time, then all at once, to a real
    ``dgpp serve`` of the packed checkpoint; the texts agree, the bench says so and exits 0."""
    from dgpp.bench.cli import main

    argv = ["serve", "--device", "cpu", "--geometry", "tiny", "--quant", "fp8_block", "--serve-cases", "2"]
    argv += ["--solo-check", "4", "--max-tokens", "6", "--prompt-tokens", "8", "--no-bench"]
    argv += ["--checkpoint-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "greedy solo == batched over 4 prompts (6 tokens each): True (4 of 4 equal)" in out


def test_solo_check_counts_a_prompt_whose_batched_text_differs(monkeypatch):
    """The check compares each prompt's text alone with its text in the batch: one that differs is counted out."""
    from dgpp.bench import serve

    async def texts(base, prompts, max_tokens):
        return [
            "alone" if len(prompts) == 1 else f"batched {i}" if i == 2 else "alone"
            for i in range(len(prompts))
        ]

    monkeypatch.setattr(serve, "greedy_texts", texts)
    assert serve.solo_equals_batched("http://unused", ["a", "b", "c", "d"], 4) == (3, 4)
