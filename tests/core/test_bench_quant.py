"""``dgpp bench --quant``: the tiny geometry quantized on the fly through the checkpoint loader's path.

Checks that bytes/step is what the packed tensors store (decoder-layer linears as encoded, lm_head and
norms dense, no embedding), that the quantized model computes what its decoded weights compute (the
dgpp dense model and transformers, both given the decoded values), and that the command runs end to end
for every format in one call.
"""

from __future__ import annotations

import re

import pytest
import torch

from dgpp.bench.cli import main
from dgpp.bench.models import build_model_like, build_pair, hf_config, weight_bytes_per_step
from dgpp.bench.quantize import (
    QUANT_CONFIGS,
    compare_with_torch_path,
    parse_variants,
    quantize_model,
    quantized_linears,
    sync_hf_weights,
)
from dgpp.engine.work import SeqWork
from dgpp.errors import ConfigError
from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel

FORMATS = ("fp8_block", "fp8_channel", "nvfp4", "mxfp4")
EXPECTED_FORMAT = {
    "fp8_block": FP8Block(block=(128, 128)),
    "fp8_channel": FP8Channel(),
    "nvfp4": NVFP4ModelOpt(),
    "mxfp4": MXFP4(data_name="weight_packed"),
}
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@pytest.fixture(scope="module")
def pair():
    return build_pair("tiny", "cpu", torch.float32, seed=3)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _logits(model, prompts: list[list[int]]) -> torch.Tensor:
    from dgpp.bench.decode import DecodeSession

    session = DecodeSession(model, len(prompts), max(map(len, prompts)) + 1, 16, graph=False)
    work = [SeqWork(b, session.tables[b], 0, p) for b, p in enumerate(prompts)]
    return session.runner.step(work).float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_per_step_are_the_stored_tensors(pair, fmt):
    dense, _ = pair
    quant = quantize_model(dense, hf_config("tiny", torch.float32), fmt)
    layers = dense.cfg.num_layers
    packed = quantized_linears(quant)
    assert sorted(packed) == sorted(f"model.layers.{i}.{name}" for i in range(layers) for name in LINEARS)
    assert all(layer.quant_method.fmt == EXPECTED_FORMAT[fmt] for layer in packed.values())
    source = dict(dense.named_parameters())
    # what a checkpoint of this format would store for the decoder-layer linears, encoded independently
    linears = sum(
        _nbytes(t) for name in packed for t in encode(EXPECTED_FORMAT[fmt], source[f"{name}.weight"]).values()
    )
    norms = sum(_nbytes(p) for n, p in dense.named_parameters() if n.endswith("norm.weight"))
    expected = linears + _nbytes(dense.lm_head.weight) + norms
    assert weight_bytes_per_step(quant) == expected
    dense_linears = sum(_nbytes(source[f"{name}.weight"]) for name in packed)
    assert linears < dense_linears / 3  # fp32 fixture: 8-bit and 4-bit codes are 4-8x smaller
    assert quant.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(quant.lm_head.weight, dense.lm_head.weight)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_logits_equal_the_decoded_weights(pair, fmt):
    dense, hf = pair
    raw = hf_config("tiny", torch.float32)
    quant = quantize_model(dense, raw, fmt)
    decoded = {n: p.detach().clone() for n, p in dense.named_parameters()}
    for name, layer in quantized_linears(quant).items():
        decoded[f"{name}.weight"] = layer.quant_method.dense_weight(layer, torch.float32)
    reference = build_model_like(raw, decoded, "cpu")
    prompts = torch.randint(0, 512, (3, 9), generator=torch.Generator().manual_seed(1)).tolist()
    ours, ref = _logits(quant, prompts), _logits(reference, prompts)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    # quantization did change the model (a pass-through would make the check above vacuous)
    assert (ours - _logits(dense, prompts)).abs().max() > 1e-3

    try:
        sync_hf_weights(hf, quant)
        for name in quantized_linears(quant):
            assert torch.equal(hf.get_parameter(f"{name}.weight"), decoded[f"{name}.weight"])
        with torch.inference_mode():
            theirs = hf(torch.tensor(prompts)).logits[:, -1].float()
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    finally:
        sync_hf_weights(hf, dense)  # the module-scoped pair keeps its original weights


def test_bench_runs_every_format_in_one_call(tmp_path, capsys):
    out = tmp_path / "table.md"
    rc = main(
        [
            "--device",
            "cpu",
            "--geometry",
            "tiny",
            "--quant",
            "bf16," + ",".join(FORMATS),
            "--cases",
            "6x2x3",
            "--hf-cases",
            "6x2x3",
            "--check-cases",
            "6x1x3",
            "--gemv",
            "both",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    text = out.read_text()
    for variant in ("fp32", *FORMATS):
        # the HF column holds a rate (on CPU its sign is timing noise): transformers ran on this variant
        row = re.search(rf"^\| 6 \| 2 \| 3 \| {variant} graph \| .* \| -?\d+\.\d \| \S+ \|$", text, re.M)
        assert row is not None, f"no table row for {variant} with a transformers rate:\n{text}"
    # --gemv both: the second row of a packed format names the generic kernel, the dense one cuBLAS
    assert "| fp32 graph, cuBLAS GEMV |" in text and "| nvfp4 graph, wo_matmul |" in text
    printed = capsys.readouterr().out
    assert all(f"{v} greedy graph == eager for 6x1x3: True" in printed for v in FORMATS)


def test_unknown_format_is_named():
    assert parse_variants("") == ["bf16"]
    assert parse_variants("nvfp4, fp8_block,nvfp4") == ["nvfp4", "fp8_block"]
    with pytest.raises(ConfigError, match="nvfp5"):
        parse_variants("fp8_block,nvfp5")
    assert set(QUANT_CONFIGS) == set(FORMATS)


def test_kernel_check_sees_a_wrong_kernel(pair, monkeypatch):
    """On CPU both paths are the torch path (agree exactly); a 'kernel' that scales its output by 1.5 when
    the torch path (``quant_torch_only``, DGPP_QUANT_TORCH) is off must show up as a large difference, and the
    switch is restored."""
    import dgpp.quant.linear as quant_linear
    from dgpp.policy import current

    dense, _ = pair
    quant = quantize_model(dense, hf_config("tiny", torch.float32), "nvfp4")
    same = compare_with_torch_path(quant, batch=2, prompt=5)
    assert same == {
        "prefill_rel_diff": 0.0,
        "prefill_argmax_agree": 1.0,
        "decode_rel_diff": 0.0,
        "decode_argmax_agree": 1.0,
        "module_rel_diff": 0.0,
        "module_worst": "",
    }
    real = quant_linear.packed_matmul

    def broken(fmt, tensors, x, shape, bias=None):
        y = real(fmt, tensors, x, shape, bias)
        return y if current().quant_torch_only else y * 1.5

    monkeypatch.setattr(quant_linear, "packed_matmul", broken)
    wrong = compare_with_torch_path(quant, batch=2, prompt=5)
    assert wrong["prefill_rel_diff"] > 0.25 and wrong["decode_rel_diff"] > 0.25
    assert wrong["module_rel_diff"] == pytest.approx(0.5, rel=1e-5)  # 0.5 y over the reference y
    assert wrong["module_worst"].startswith("model.layers.")
    assert not current().quant_torch_only


def test_a_failing_format_keeps_the_others(tmp_path, monkeypatch):
    import dgpp.bench.cli as cli

    real = cli.quantize_model

    def flaky(source, raw, fmt, release=None):
        if fmt == "fp8_channel":
            raise RuntimeError("kernel did not compile")
        return real(source, raw, fmt, release)

    monkeypatch.setattr(cli, "quantize_model", flaky)
    out = tmp_path / "table.md"
    rc = main(
        [
            "--device",
            "cpu",
            "--geometry",
            "tiny",
            "--quant",
            "fp8_channel,mxfp4",
            "--cases",
            "6x1x3",
            "--hf-cases",
            "",
            "--check-cases",
            "",
            "--out",
            str(out),
        ]
    )
    text = out.read_text()
    assert rc == 1
    assert "| mxfp4 graph |" in text and "fp8_channel failed: RuntimeError('kernel did not compile')" in text
