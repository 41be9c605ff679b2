"""``dgpp bench --quant`` on MoE geometries: routed experts packed per expert from the stacked dense source, under
the names and dense-module rules of each family's releases (the geometry's ``PackedRelease``).

Checks that every routed-expert stack really is packed in the spec's experts format and the other decoder-layer
linears in its linears format (what the release keeps dense stays dense), that the loader was answered the release's
per-expert names, that the packed model computes exactly what its decoded weights compute and stays within the
format's quantization error of the dense source, that bytes/step count the routed experts as packed, that
transformers is given the decoded experts, and that a bad format name is one ConfigError.
"""

from __future__ import annotations

import re

import pytest
import torch

from dgpp.bench import encoding_reader
from dgpp.bench.cli import main
from dgpp.bench.decode import prefill_flops
from dgpp.bench.encoding_reader import EncodingReader
from dgpp.bench.models import build_model_like, build_pair, hf_config, packed_release, weight_bytes_per_step
from dgpp.bench.quantize import parse_variants, quantize_model, split_spec, sync_hf_weights
from dgpp.bench.step_bytes import (
    decode_step_bytes,
    logical_weight_elements,
    moe_layers,
    packed_experts,
    quantized_linears,
)
from dgpp.engine.work import SeqWork
from dgpp.errors import ConfigError
from dgpp.nn.moe import FusedExperts
from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.moe import PROJECTIONS, QuantExperts

FP8 = FP8Block(block=(128, 128))
# geometry -> (spec, experts' format, linears' format, linears the release keeps dense, largest allowed
# |output diff| / |output| of a packed expert stack against its dense source: 4-bit gate/up and down errors compound)
CASES = {
    "tiny-qwen3.5-moe": ("nvfp4", NVFP4ModelOpt(), None, ("linear_attn.", "shared_expert"), 0.25),
    "tiny-mimo-v2.6": ("mxfp4+fp8_block", MXFP4(), FP8, ("self_attn.o_proj",), 0.25),
    "tiny-deepseek-v4": ("mxfp4+fp8_block", MXFP4(), FP8, ("compressor.wkv", "compressor.wgate"), 0.25),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(scope="module", params=sorted(CASES))
def packed(request):
    geometry = request.param
    spec = CASES[geometry][0]
    dense, _ = build_pair(geometry, "cpu", torch.float32, seed=5, with_hf=False)
    raw = hf_config(geometry, torch.float32)
    return geometry, dense, quantize_model(dense, raw, spec, packed_release(geometry))


def _logits(model, prompts: list[list[int]]) -> torch.Tensor:
    from dgpp.bench.decode import DecodeSession

    session = DecodeSession(model, len(prompts), max(map(len, prompts)) + 1, 16, graph=False)
    work = [SeqWork(b, session.tables[b], 0, p) for b, p in enumerate(prompts)]
    return session.runner.step(work).float()


def _prompts(model) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(1, model.info.vocab_size, (3, 9), generator=gen).tolist()


def test_every_expert_stack_is_packed_in_the_release_layout(packed):
    geometry, dense, quant = packed
    _, experts_fmt, linears_fmt, kept_dense, _ = CASES[geometry]
    assert not any(isinstance(m, FusedExperts) for m in quant.modules())
    stacks = [moe.experts for moe in moe_layers(quant)]
    assert stacks and len(stacks) == len(moe_layers(dense))
    for stack in stacks:
        assert isinstance(stack, QuantExperts)
        assert all(getattr(stack, p).fmt == experts_fmt for p in PROJECTIONS)
        assert all(p.dtype == torch.uint8 or p.dtype == torch.float32 for p in stack.parameters())
    linears = quantized_linears(quant)
    if linears_fmt is None:  # the NVFP4 release packs the routed experts only
        assert linears == {}
    else:
        assert linears and all(layer.quant_method.fmt == linears_fmt for layer in linears.values())
    for name, module in quant.named_modules():
        if any(part in name for part in kept_dense) and hasattr(module, "quant_method"):
            assert name not in linears, f"{name} is kept dense by the release"
    assert not any(name.endswith("lm_head") or name == "head" for name in linears)


def test_the_loader_was_answered_the_release_names(packed, monkeypatch):
    geometry, dense, _ = packed
    asked: list[str] = []
    real = EncodingReader.get

    def get(self, name):
        asked.append(name)
        return real(self, name)

    encoded: list[tuple[int, ...]] = []
    real_encode = encoding_reader.encode

    def encode_once(fmt, weight):
        encoded.append(tuple(weight.shape))
        return real_encode(fmt, weight)

    monkeypatch.setattr(EncodingReader, "get", get)
    monkeypatch.setattr(encoding_reader, "encode", encode_once)
    quant = quantize_model(
        dense, hf_config(geometry, torch.float32), CASES[geometry][0], packed_release(geometry)
    )
    # every packed weight encoded once (an expert's slice, not the stack), whatever number of tensors it stores
    experts = sum(3 * m.num_experts for m in packed_experts(quant).values())
    assert len(encoded) == len(quantized_linears(quant)) + experts
    names = set(asked)
    if geometry == "tiny-deepseek-v4":  # the release's own names: w1 gate, w3 up, w2 down, scales as .scale
        layer = next(n for n in names if ".ffn.experts.7.w1.weight" in n).split(".ffn.")[0]
        expected = {f"{layer}.ffn.experts.7.{w}.{s}" for w in ("w1", "w2", "w3") for s in ("weight", "scale")}
        assert expected <= names and f"{layer}.attn.wq_a.scale" in names
    else:
        layer = next(n for n in names if ".mlp.experts.7.gate_proj." in n).split(".mlp.")[0]
        suffixes = list(CASES[geometry][1].tensor_shapes((64, 64)))
        assert {f"{layer}.mlp.experts.7.{p}.{s}" for p in PROJECTIONS for s in suffixes} <= names
    # one request per stored tensor, none for the stacked dense experts
    assert len(asked) == len(names)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)


@torch.inference_mode()
def test_packed_logits_are_the_decoded_weights_and_near_the_dense_source(packed):
    geometry, dense, quant = packed
    decoded = {n: p.detach().clone() for n, p in dense.named_parameters()}
    for name, layer in quantized_linears(quant).items():
        decoded[f"{name}.weight"] = layer.quant_method.dense_weight(layer, torch.float32)
    for moe_name, moe in ((n, m) for n, m in quant.named_modules() if isinstance(m, QuantExperts)):
        for e in range(moe.num_experts):
            gate, up, down = (moe.expert_weight(p, e, torch.float32) for p in PROJECTIONS)
            decoded[f"{moe_name}.gate_up_proj"][e] = torch.cat([gate, up])
            decoded[f"{moe_name}.down_proj"][e] = down
    reference = build_model_like(hf_config(geometry, torch.float32), decoded, "cpu")
    prompts = _prompts(quant)
    ours, ref, source = _logits(quant, prompts), _logits(reference, prompts), _logits(dense, prompts)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    # changed by quantization, but still the source's model (random tiny weights amplify 4-bit errors, and a
    # flipped routing pick moves a token to another expert)
    error = float((ours - source).norm() / source.norm())
    assert 1e-3 < error < 0.5, error


@torch.inference_mode()
def test_each_packed_expert_stack_is_its_dense_stack_within_the_format_error(packed):
    """Every layer's packed experts against the source's dense experts on the same rows and routing: the
    output within the 4-bit error (MXFP4 / NVFP4 weights are ~10 % off in norm, the SwiGLU output of two such products ~20 %), each expert's decoded weights
    too; a swapped or misplaced slice (gate for up, another expert) would be off by ~140 %."""
    geometry, dense, quant = packed
    gen = torch.Generator().manual_seed(7)
    pairs = list(zip(moe_layers(dense), moe_layers(quant), strict=True))
    for dense_moe, quant_moe in pairs:
        ours, theirs = quant_moe.experts, dense_moe.experts
        rows, experts = 12, theirs.num_experts
        x = torch.randn(rows, theirs.down_proj.shape[1], generator=gen)
        ids = torch.rand(rows, experts, generator=gen).argsort(-1)[:, :2]
        weights = torch.rand(rows, 2, generator=gen)
        want = theirs(x, weights, ids)
        assert float((ours(x, weights, ids) - want).norm() / want.norm()) < CASES[geometry][4]
        for e in range(experts):
            gate_up = torch.cat([ours.expert_weight(p, e, torch.float32) for p in PROJECTIONS[:2]])
            for got, source in (
                (gate_up, theirs.gate_up_proj[e]),
                (ours.expert_weight("down_proj", e, torch.float32), theirs.down_proj[e]),
            ):
                assert 0.01 < float((got - source).norm() / source.norm()) < 0.15


def test_bytes_per_step_count_the_routed_experts_as_packed(packed):
    geometry, dense, quant = packed
    source = dict(dense.named_parameters())
    fmt = CASES[geometry][1]
    # one expert of every MoE layer as a release stores it, encoded independently of the model
    per_expert = 0
    for name, module in dense.named_modules():
        if isinstance(module, FusedExperts):
            gate_up, down = source[f"{name}.gate_up_proj"][0], source[f"{name}.down_proj"][0]
            inter = module.inter
            for weight in (gate_up[:inter], gate_up[inter:], down):
                per_expert += sum(_nbytes(t) for t in encode(fmt, weight).values())
    dense_per_expert = sum(
        _nbytes(m.gate_up_proj[0]) + _nbytes(m.down_proj[0])
        for m in dense.modules()
        if isinstance(m, FusedExperts)
    )
    for model, expert_bytes in ((quant, per_expert), (dense, dense_per_expert)):
        five, two = (decode_step_bytes(model, 4, 10.0, experts_read=r) for r in (5, 2))
        assert five - two == pytest.approx(3 * expert_bytes)
    assert per_expert < dense_per_expert / 4  # fp32 source: 4-bit codes are ~7x smaller
    # FLOP counts see the logical experts, not their packed bytes
    assert logical_weight_elements(quant, weight_bytes_per_step(quant)) == logical_weight_elements(
        dense, weight_bytes_per_step(dense)
    )
    assert prefill_flops(quant, 8) == prefill_flops(dense, 8)


@torch.inference_mode()
def test_transformers_runs_the_decoded_experts():
    geometry = "tiny-qwen3.5-moe"  # transformers builds it under dgpp's names
    dense, hf = build_pair(geometry, "cpu", torch.float32, seed=5)
    assert hf is not None
    quant = quantize_model(dense, hf_config(geometry, torch.float32), "nvfp4", packed_release(geometry))
    prompts = _prompts(quant)
    sync_hf_weights(hf, quant)
    name, moe = next((n, m) for n, m in quant.named_modules() if isinstance(m, QuantExperts))
    gate_up = [moe.expert_weight(p, 3, torch.float32) for p in PROJECTIONS[:2]]
    assert torch.equal(hf.get_parameter(f"{name}.gate_up_proj")[3], torch.cat(gate_up))
    assert torch.equal(
        hf.get_parameter(f"{name}.down_proj")[3], moe.expert_weight("down_proj", 3, torch.float32)
    )
    theirs = hf(torch.tensor(prompts)).logits[:, -1].float()
    torch.testing.assert_close(_logits(quant, prompts), theirs, rtol=1e-4, atol=1e-4)
    assert (theirs - _logits(dense, prompts)).abs().max() > 1e-3  # transformers did change its weights


@torch.inference_mode()
def test_release_spec_packs_the_shipped_layout_per_layer_and_projection():
    """``--quant release``: Flint's export mixes FP8 block-128 and NVFP4 experts across layers and within one
    layer's gate/up/down, everything else BF16; transformers runs the decoded experts."""
    from dgpp.quant.fp4 import NVFP4CompressedTensors
    from dgpp_flint.testing import MIXED_EXPERT_FORMATS

    formats = {
        "fp8": FP8Block(block=(128, 128), scale_name="weight_scale"),
        "nvfp4": NVFP4CompressedTensors(),
    }
    dense, hf = build_pair("tiny-flint", "cpu", torch.float32, seed=5)
    quant = quantize_model(
        dense, hf_config("tiny-flint", torch.float32), "release", packed_release("tiny-flint")
    )
    stacks = packed_experts(quant)
    assert quantized_linears(quant) == {}
    assert sorted(stacks) == [f"model.layers.{i}.mlp.experts" for i in sorted(MIXED_EXPERT_FORMATS)]
    for layer, per_proj in MIXED_EXPERT_FORMATS.items():
        stack = stacks[f"model.layers.{layer}.mlp.experts"]
        assert {p: getattr(stack, p).fmt for p in PROJECTIONS} == {p: formats[k] for p, k in per_proj.items()}
    assert hf is not None
    prompts = _prompts(quant)
    sync_hf_weights(hf, quant)
    theirs = hf(torch.tensor(prompts)).logits[:, -1].float()
    torch.testing.assert_close(_logits(quant, prompts), theirs, rtol=1e-4, atol=1e-4)
    assert (theirs - _logits(dense, prompts)).abs().max() > 1e-3


def test_release_spec_reads_each_release_and_needs_one():
    dense, _ = build_pair("tiny-deepseek-v4", "cpu", torch.float32, with_hf=False)
    quant = quantize_model(
        dense, hf_config("tiny-deepseek-v4", torch.float32), "release", packed_release("tiny-deepseek-v4")
    )
    e8m0 = FP8Block(block=(128, 128), scale_format="e8m0")  # the release's ue8m0 block scales
    assert {layer.quant_method.fmt for layer in quantized_linears(quant).values()} == {e8m0}
    assert all(getattr(s, p).fmt == MXFP4() for s in packed_experts(quant).values() for p in PROJECTIONS)
    v41, _ = build_pair("tiny-deepseek-v41", "cpu", torch.float32, with_hf=False)  # drawn packed already
    with pytest.raises(ConfigError, match="already packed in its release's formats"):
        quantize_model(
            v41, hf_config("tiny-deepseek-v41", torch.float32), "nvfp4", packed_release("tiny-deepseek-v41")
        )
    tiny, _ = build_pair("tiny", "cpu", torch.float32, with_hf=False)
    with pytest.raises(ConfigError, match="--quant release: this geometry names no release layout"):
        quantize_model(tiny, hf_config("tiny", torch.float32), "release", packed_release("tiny"))


def test_a_transformers_model_named_its_own_way_is_no_baseline(capsys):
    """transformers' DeepSeek-V4 names its tensors otherwise (``model.embed_tokens`` for ``embed``): the HF
    column is left out with one line saying why, instead of a missing-tensor error."""
    dense, hf = build_pair("tiny-deepseek-v4", "cpu", torch.float32)
    assert hf is None and dense is not None
    assert "transformers names the weights its own way (no 'embed.weight'" in capsys.readouterr().out


def test_bad_format_names_are_one_config_error():
    assert split_spec("nvfp4") == ("nvfp4", "nvfp4")
    assert split_spec("mxfp4+fp8_block") == ("mxfp4", "fp8_block")
    assert split_spec("nvfp4+bf16") == ("nvfp4", "bf16")
    assert parse_variants("bf16,mxfp4+fp8_block,release") == ["bf16", "mxfp4+fp8_block", "release"]
    for bad in ("mxfp4+fp9", "bf16+nvfp4", "mxfp4+", "nvfp4+fp8_block+mxfp4"):
        with pytest.raises(ConfigError, match="EXPERTS\\+LINEARS"):
            parse_variants(f"nvfp4,{bad}")
    dense, _ = build_pair("tiny-qwen3.5-moe", "cpu", torch.float32, with_hf=False)
    with pytest.raises(ConfigError, match="'nvfp5'"):
        quantize_model(dense, hf_config("tiny-qwen3.5-moe", torch.float32), "nvfp5")


def test_bench_serve_refuses_a_packed_moe_checkpoint(tmp_path):
    from dgpp.bench.checkpoint import write_checkpoint

    with pytest.raises(ConfigError, match="packed checkpoints of dense geometries only"):
        write_checkpoint("tiny-qwen3.5-moe", tmp_path / "ckpt", "cpu", torch.float32, quant="nvfp4")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("geometry", "spec", "hf_cases"),
    [("tiny-deepseek-v4", "mxfp4+fp8_block", ""), ("tiny-qwen3.5-moe", "bf16,nvfp4", "6x2x3")],
)
def test_bench_runs_packed_moe_formats(tmp_path, capsys, geometry, spec, hf_cases):
    out = tmp_path / "table.md"
    argv = ["--device", "cpu", "--geometry", geometry, "--quant", spec, "--cases", "6x2x3"]
    argv += ["--hf-cases", hf_cases, "--check-cases", "6x1x3", "--out", str(out)]
    assert main(argv) == 0
    text, printed = out.read_text(), capsys.readouterr().out
    packed = spec.split(",")[-1]
    # with --hf-cases the transformers column holds a rate (its sign is CPU timing noise)
    rate = r"-?\d+\.\d" if hf_cases else "-"
    assert re.search(
        rf"^\| 6 \| 2 \| 3 \| {re.escape(packed)} graph \| .* \| {rate} \| \S+ \|$", text, re.M
    ), text
    assert f"{packed} greedy graph == eager for 6x1x3: True" in printed


def test_kernel_check_names_a_wrong_expert_stack(packed, monkeypatch):
    """The bench's kernel check compares each packed module with the torch path on the same inputs: an expert
    stack whose kernel path is off by half its output is named, with the error it makes, and nothing is left
    hooked after."""
    from dgpp.bench.quantize import compare_with_torch_path
    from dgpp.policy import current

    _, _, quant = packed
    real = QuantExperts.forward

    def wrong(self, x, weights, ids):
        y = real(self, x, weights, ids)
        return y if current().quant_torch_only else y * 1.5

    assert compare_with_torch_path(quant, batch=2, prompt=5)["module_rel_diff"] == 0.0
    monkeypatch.setattr(QuantExperts, "forward", wrong)
    check = compare_with_torch_path(quant, batch=2, prompt=5)
    assert check["module_rel_diff"] == pytest.approx(0.5, rel=1e-5)  # 0.5 y over the reference y
    assert check["module_worst"].endswith("experts")
    assert all(not m._forward_hooks for m in quant.modules())
