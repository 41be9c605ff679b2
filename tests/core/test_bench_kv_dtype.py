"""``dgpp bench --kv-dtype``: the decode sweep with the K/V cache stored as ``engine.kv_dtype`` says, on the tiny
qwen3 geometry (2 layers, 2 KV heads of 16, fp32) on CPU.

Checks that the session's pools hold e4m3 codes with fp32 row scales under fp8 (and that the model reads them: the
logits move), that bytes/step shrink by exactly the stored row sizes, that long prompts are prefilled in bounded
steps with the same tokens as one step, and that the command prints one table with a row per format (a refused
format as its row)."""

from __future__ import annotations

import re

import pytest
import torch

from dgpp.bench import decode
from dgpp.bench.cli import main, parse_kv_dtypes
from dgpp.bench.decode import DecodeSession, random_prompts, run_case
from dgpp.bench.models import build_random_model, hf_config
from dgpp.bench.step_bytes import decode_step_bytes
from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.errors import ConfigError
from dgpp.step.cache_spec import KV_FP8

FP32, SCALE = 4, 4


@pytest.fixture(scope="module")
def model():
    return build_random_model("tiny", "cpu", torch.float32, seed=5)


def _kv_shape() -> tuple[int, int, int]:
    raw = hf_config("tiny", torch.float32)
    return raw["num_hidden_layers"], raw["num_key_value_heads"], raw["head_dim"]


def test_fp8_pools_hold_e4m3_rows_with_row_scales(model):
    layers, kv_heads, head_dim = _kv_shape()
    exact = DecodeSession(model, 2, 40, 16, graph=False)
    lossy = DecodeSession(model, 2, 40, 16, graph=False, kv_dtype="fp8")
    assert len(lossy.pools.kv) == layers and not exact.pools.kv_scales
    for name, (k, v) in lossy.pools.kv.items():
        assert k.dtype == v.dtype == KV_FP8 and k.shape[-2:] == (kv_heads, head_dim)
        k_scale, v_scale = lossy.pools.kv_scales[name]
        assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.shape[-2:] == (kv_heads, 1)
        assert exact.pools.kv[name][0].dtype == torch.float32
    prompts = random_prompts(2, 30, model.info.vocab_size, seed=1)
    exact.prefill(prompts)
    lossy.prefill(prompts)
    # the prompt rows were written as codes with their scales, and the attention reads them back: rounding to
    # e4m3 moves the next step's logits, though only by rounding
    assert all(bool((s[0] > 0).any()) for s in lossy.pools.kv_scales.values())
    fed = random_prompts(2, 1, model.info.vocab_size, seed=2)
    ours, ref = (
        s.runner.step([SeqWork(b, s.tables[b], 30, fed[b]) for b in range(2)]) for s in (lossy, exact)
    )
    moved = float((ours - ref).abs().max() / ref.abs().max())
    assert 0 < moved < 0.25  # measured 0.043 (seed 5)


def test_step_bytes_count_the_rows_as_stored(model, monkeypatch):
    layers, kv_heads, head_dim = _kv_shape()
    per_token_fp32 = layers * kv_heads * 2 * head_dim * FP32
    per_token_fp8 = layers * kv_heads * (2 * head_dim + 2 * SCALE)  # 1-byte codes plus an fp32 scale per row
    for batch, context in ((1, 10.0), (3, 37.5)):
        auto = decode_step_bytes(model, batch, context)
        fp8 = decode_step_bytes(model, batch, context, kv_dtype="fp8")
        assert auto - fp8 == batch * context * (per_token_fp32 - per_token_fp8)
    # a whole case: the same decode under both formats, bytes apart by the rows of its mean context, the timed
    # session's pools stored as each format says
    sessions: list[DecodeSession] = []

    class Recorded(DecodeSession):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            sessions.append(self)

    monkeypatch.setattr(decode, "DecodeSession", Recorded)
    cases = {kv: run_case(model, 9, 2, 4, graph=True, copy_gbs=1.0, kv_dtype=kv) for kv in ("auto", "fp8")}
    stored = [{k.dtype for k, _ in s.pools.kv.values()} for s in sessions]
    assert stored == [{torch.float32}, {KV_FP8}]
    mean_context = 9 + 1 + (4 - 1 - 1) / 2
    gap = cases["auto"].step_bytes - cases["fp8"].step_bytes
    assert gap == 2 * mean_context * (per_token_fp32 - per_token_fp8)


def test_a_format_the_model_does_not_store_is_refused(model):
    with pytest.raises(ConfigError, match="fp4"):
        DecodeSession(model, 1, 16, 16, graph=False, kv_dtype="fp4")
    with pytest.raises(ConfigError, match="fp4"):
        decode_step_bytes(model, 1, 10.0, kv_dtype="fp4")
    assert parse_kv_dtypes("") == ["auto"]
    assert parse_kv_dtypes("fp8, auto,fp8") == ["fp8", "auto"]
    with pytest.raises(ConfigError, match="--kv-dtype.*fp6"):
        parse_kv_dtypes("auto,fp6")


def test_long_prompts_prefill_in_bounded_steps_with_the_same_tokens(model, monkeypatch):
    prompts = random_prompts(3, 45, model.info.vocab_size, seed=4)
    whole = DecodeSession(model, 3, 60, 16, graph=False)
    want = whole.decode(whole.prefill(prompts), 45, 4)
    rows: list[int] = []
    real = ModelRunner.step

    def counted(self, works, *args, **kwargs):
        rows.append(sum(len(w.token_ids) for w in works))
        return real(self, works, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "step", counted)
    chunked = DecodeSession(model, 3, 60, 16, graph=False)
    got = chunked.decode(chunked.prefill(prompts, step_tokens=32), 45, 4)
    assert got == want
    # 32 rows a step over 3 prompts: 10-token chunks, the last one of 5
    assert rows[:5] == [30, 30, 30, 30, 15] and max(rows) <= 32
    # run_case prefills in steps of PREFILL_STEP_TOKENS
    rows.clear()
    monkeypatch.setattr(decode, "PREFILL_STEP_TOKENS", 24)
    run_case(model, 45, 3, 3, graph=False, copy_gbs=1.0)
    assert rows[:6] == [24, 24, 24, 24, 24, 15]


def test_bench_prints_one_table_row_per_kv_dtype(tmp_path, capsys):
    out = tmp_path / "table.md"
    rc = main(
        [
            "--device",
            "cpu",
            "--geometry",
            "tiny",
            "--kv-dtype",
            "auto,fp8,fp4",
            "--cases",
            "6x2x3",
            "--hf-cases",
            "6x2x3",
            "--check-cases",
            "6x1x3",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = out.read_text()
    for kv in ("auto", "fp8"):  # a measured row, with transformers' rate beside it
        row = re.search(
            rf"^\| 6 \| 2 \| 3 \| kv {kv} graph \| \d+\.\d\d \| .* \| -?\d+\.\d \| \S+ \|$", text, re.M
        )
        assert row is not None, f"no table row for kv {kv}:\n{text}"
    assert re.search(r"^\| 6 \| 2 \| 3 \| kv fp4 graph \| refused \|", text, re.M), text
    assert "kv fp4 refused: engine.kv_dtype: 'fp4' stores MLA latents" in text
    assert "K/V cache auto, fp8, fp4" in text
    printed = capsys.readouterr().out
    assert "kv fp8 greedy graph == eager for 6x1x3: True" in printed
    assert printed.count("transformers:") == 1  # measured once, shown beside every format's row
