"""``engine.gguf_weights: int4pack``: a GGUF's Q4_1 / Q8_0 matrices multiplied packed on the CPU through torch's
int4 product (``dgpp.checkpoint.gguf_packed``, ``dgpp.nn.int4pack_cpu``).

The mapping onto the int4 layout is checked exactly (with fp32 scales the packed weights are the GGUF's weights,
bit for bit), the bf16 product against decode-then-multiply within the bf16 tolerance, a row alone against the
same row among 1..300 rows bit for bit, a layout whose rows depend on the batch is refused, and a whole model
loaded with the key multiplies through the int4 product (a load or a step that falls back to decoded weights
fails) with solo == batched logits, and the memory plan counts the packed weights the loaded model keeps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from dgpp.checkpoint import gguf_packed
from dgpp.checkpoint.gguf_blocks import decode_blocks
from dgpp.checkpoint.resolve import resolve_checkpoint
from dgpp.config_schema import EngineConfig
from dgpp.errors import ConfigError
from dgpp.nn import int4pack_cpu, second_core
from dgpp.nn.embedding import LMHead
from dgpp.nn.int4pack_cpu import GROUP, Int4PackLinearMethod, int4pack_available, pack_codes
from dgpp.nn.linear import Linear
from dgpp.nn.second_core import usable_cores
from dgpp.plugins import build_manager
from dgpp.startup.loading import load_context, load_model
from dgpp.startup.memory_plan import plan_for
from dgpp.testing import conformance as conf
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.second_core import counted_splits
from dgpp.testing.tokenizers import build_tiny_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip(
    "dgpp_llama", reason="the example plugin (examples/dgpp-example-plugin) is installed by scripts/setup.sh"
)
if not int4pack_available():
    pytest.skip("this torch has no CPU int4 product", allow_module_level=True)

from gguf_writer import write_llama_gguf  # noqa: E402  (needs gguf)

INT4_OP = "aten::_weight_int4pack_mm_for_cpu"


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DGPP_GGUF_DIR", str(tmp_path / "gguf-cache"))


def blocks_of(kind: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Raw ``[n, k / 32 * bytes]`` blocks of a random matrix, quantized by the ``gguf`` package (as llama.cpp)."""
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1).copy())


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_fp32_scales_give_the_gguf_weights_bit_for_bit(kind):
    """The layout and the math: codes, scales and zeros in fp32 through torch's int4 product (its fp32 kernel)
    multiply an identity into exactly the weights ggml's dequantizer gives."""
    n, k = 64, 128
    rows = blocks_of(kind, n, k, seed=1)
    operands, planes = gguf_packed.OPERANDS[kind]
    codes, scale_zeros = operands(rows, torch.float32)
    if kind == "Q4_1":  # z = m + 8 d is exact in fp32 for these blocks (else the mapping would round it)
        _, d, m = gguf_packed.q4_1_fields(rows.reshape(-1, 20))
        assert torch.equal((m.double() + 8 * d.double()).float().double(), m.double() + 8 * d.double())
    eye = torch.eye(k).repeat(1, planes)
    weights = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, pack_codes(codes), GROUP, scale_zeros).t()
    assert torch.equal(weights, decode_blocks(rows, kind))


@pytest.mark.parametrize(
    ("kind", "n"), [("Q4_1", 192), ("Q4_0", 192), ("Q8_0", 192), ("Q4_1", 40)]
)  # 40: padded to 48 outputs
def test_packed_product_equals_decode_then_multiply_within_bf16(kind, n):
    k = 256
    rows = blocks_of(kind, n, k, seed=2)
    packed = gguf_packed.packed_weight(rows, kind)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(3))
    reference = x.double() @ decode_blocks(rows, kind).double().t()
    ours = packed(x)
    assert ours.dtype == torch.float32 and ours.shape == (7, n) and ours.is_contiguous()
    error = float((ours.double() - reference).abs().max() / reference.abs().max())
    assert error < 2e-2, error  # bf16 inputs, scales and outputs
    assert not torch.equal(ours.double(), reference)  # it is the packed chain, not an fp32 decode


@pytest.mark.parametrize(("kind", "n"), [("Q4_1", 128), ("Q8_0", 128), ("Q8_0", 72)])
def test_a_row_alone_equals_the_row_among_many(kind, n):
    k = 192
    packed = gguf_packed.packed_weight(blocks_of(kind, n, k, seed=4), kind)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(300)])
    for count in (1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 65, 255, 256, 257, 300):
        assert torch.equal(packed(x[:count]), alone[:count]), count


def test_joined_products_equal_each_part_alone():
    """q/k/v (and gate/up) join their packed weights into one product: each part's outputs keep their bits."""
    parts = [gguf_packed.packed_weight(blocks_of("Q4_1", n, 128, seed=20 + n), "Q4_1") for n in (128, 64, 64)]
    joined = int4pack_cpu.concat_packed(parts)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert torch.equal(joined(x), torch.cat([part(x) for part in parts], dim=-1))
    x_t = (
        torch.randn(128, 5, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).t()
    )  # not contiguous
    assert torch.equal(joined(x_t), joined(x_t.contiguous()))
    assert (
        int4pack_cpu.concat_packed(
            [parts[0], gguf_packed.packed_weight(blocks_of("Q4_1", 40, 128, 8), "Q4_1")]
        )
        is None
    )


@pytest.mark.skipif(usable_cores() < 2, reason="needs a second core")
def test_a_head_sized_decode_row_runs_on_two_cores_with_the_whole_products_bits(monkeypatch):
    """A decode row's product of at least ``SPLIT_MIN_OUTPUTS`` outputs, on one intra-op thread of a machine with
    more cores, runs as two halves of the outputs, one on the helper thread: every output keeps the bits of the
    whole product; several rows do not split."""
    n = second_core.SPLIT_MIN_OUTPUTS + 40  # padded to a multiple of 16, cut at a multiple of 64
    packed = gguf_packed.packed_weight(blocks_of("Q8_0", n, 64, seed=9), "Q8_0")
    with counted_splits(monkeypatch, int4pack_cpu) as splits:
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
        scale_zeros = packed.contiguous_scale_zeros()
        for row in x.split(1):
            whole = int4pack_cpu.int4pack_product(row.repeat(1, packed.planes), packed.packed, scale_zeros)
            assert torch.equal(packed(row), whole[:, :n])
        assert len(splits) >= 3  # the decode rows split (besides the once-per-shape check)
        splits.clear()
        assert torch.equal(packed(x), torch.cat([packed(row) for row in x.split(1)]))
        assert len(splits) == 3  # the three-row call did not split; its rows alone did


def test_a_layout_whose_rows_depend_on_the_batch_is_refused(monkeypatch):
    """A product that sums a several-row call in another order than the row alone gets one row a call."""
    real = int4pack_cpu.int4pack_product

    def batch_dependent(x, packed, scale_zeros):
        out = real(x, packed, scale_zeros)
        return out if x.shape[0] < 5 else (out.float() * (1 + 2**-7)).to(out.dtype)

    monkeypatch.setattr(int4pack_cpu, "_row_limits", {})
    assert int4pack_cpu.int4pack_row_limit(64, 128) == int4pack_cpu.ROW_BATCH  # the real kernel passes
    monkeypatch.setattr(int4pack_cpu, "_row_limits", {})
    monkeypatch.setattr(int4pack_cpu, "int4pack_product", batch_dependent)
    assert int4pack_cpu.int4pack_row_limit(64, 128) == 1


def mixed_quant(name: str, tensor: torch.Tensor) -> str:
    """Q4_1 for every projection, Q8_0 for the (tied) embedding: the demo's mix."""
    if tensor.dim() == 1:
        return "F32"
    return "Q8_0" if "embed_tokens" in name else "Q4_1"


def converted_gguf(tmp_path, tied: bool = True, tensor_type=mixed_quant):
    # 4 KV heads: k and v are 64 rows, so q/k/v join into one packed product like the demo's
    hf = build_tiny_checkpoint(
        "llama", tmp_path / "hf", seed=11, overrides={"tie_word_embeddings": tied, "num_key_value_heads": 4}
    )
    build_tiny_tokenizer(hf)
    return resolve_checkpoint(
        str(write_llama_gguf(hf, tmp_path / "q" / "tiny.gguf", tensor_type=tensor_type))
    )


@pytest.fixture
def tiny_gguf(tmp_path):
    return converted_gguf(tmp_path)


def int4_calls(model, prompt: list[int]) -> int:
    conf.engine_all_logits(model, [prompt])  # the first products check their shapes (int4pack_row_limit)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        conf.engine_all_logits(model, [prompt])
    return sum(1 for e in prof.events() if e.name == INT4_OP)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_model_loaded_with_the_key_multiplies_packed(tiny_gguf, dtype):
    model = load_model(tiny_gguf, EngineConfig(gguf_weights="int4pack"), dtype=dtype)
    decoded = load_model(tiny_gguf, dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.quant_method, Int4PackLinearMethod) for m in linears)
    assert all("weight" not in m._parameters for m in linears)  # the decoded copies are gone
    heads = [m for m in model.modules() if isinstance(m, LMHead)]
    assert len(heads) == 1 and heads[0].packed is not None and heads[0].packed.planes == 2  # Q8_0: two planes
    prompt = conf.make_prompts(model.info.vocab_size, (9,), seed=12)[0]
    layers = model.config.num_hidden_layers
    # per layer one q/k/v, one o, one gate/up and one down product; the head: a step that decodes any of
    # them instead (a silent fall-back) makes fewer calls
    assert int4_calls(model, prompt) == 4 * layers + 1
    ours, reference = conf.engine_all_logits(model, [prompt])[0], conf.engine_all_logits(decoded, [prompt])[0]
    error = float((ours.float() - reference).abs().max() / reference.abs().max())
    assert 0 < error < 5e-2, error


def test_packed_rows_are_batch_and_chunk_invariant(tiny_gguf):
    model = load_model(tiny_gguf, EngineConfig(gguf_weights="int4pack"), dtype=torch.bfloat16)
    prompts = conf.make_prompts(model.info.vocab_size, (3, 11, 26), seed=13)
    conf.check_batch_invariance(model, prompts)
    conf.check_chunk_invariance(model, prompts, chunk_sizes=(1, 5))
    conf.check_mixed_batch(model, prompts, max_new_tokens=6)


def test_the_key_needs_a_converted_gguf(tmp_path):
    hf = build_tiny_checkpoint("llama", tmp_path / "hf", seed=14)
    with pytest.raises(ConfigError, match="engine.gguf_weights"):
        load_model(hf, EngineConfig(gguf_weights="int4pack"))


def test_the_key_is_a_lossy_lever():
    assert "gguf_weights" in EngineConfig(gguf_weights="int4pack").lossy_levers()
    assert "gguf_weights" not in EngineConfig().lossy_levers()


def resident_bytes_of(model: torch.nn.Module) -> int:
    """What a model keeps: its (unique) parameters and the storages of its packed weights' codes, scales and
    zeros, the joined q/k/v and gate/up weights' (cached on their first layer) included."""
    packed = [m for m in model.modules() if isinstance(m, int4pack_cpu.Int4PackedWeight)]
    packed += [m._dgpp_int4_joined[1] for m in model.modules() if getattr(m, "_dgpp_int4_joined", None)]
    storages = {
        b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for m in packed for b in m.buffers()
    }
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(storages.values())


def head_quant(name: str, tensor: torch.Tensor) -> str:
    """Q4_0 projections, a Q4_1 head and an F16 embedding (untied): every packed type, and a head kept beside
    its decoded weight."""
    if tensor.dim() == 1 or "embed_tokens" in name:
        return "F32" if tensor.dim() == 1 else "F16"
    return "Q4_1" if "lm_head" in name else "Q4_0"


@pytest.mark.parametrize("tied", [True, False])
def test_the_plan_counts_the_packed_weights(tmp_path, tied):
    """The planned weight bytes are the loaded model's resident bytes under the key (codes, bf16 scales and
    zeros; the decoded Linear weights dropped, the head's kept), not the decoded weights'."""
    checkpoint = converted_gguf(tmp_path, tied, mixed_quant if tied else head_quant)
    engine, pm = EngineConfig(gguf_weights="int4pack"), build_manager()
    plan = plan_for(pm, load_context(checkpoint, engine, dtype=torch.bfloat16, pm=pm))
    model = load_model(checkpoint, engine, dtype=torch.bfloat16, pm=pm)
    assert [m for m in model.modules() if isinstance(m, LMHead)][0].packed is not None
    decoded = plan_for(pm, load_context(checkpoint, dtype=torch.bfloat16, pm=pm)).weights
    assert plan.weights == resident_bytes_of(model) < decoded  # a plan that ignores the key counts `decoded`
    prompt = conf.make_prompts(model.info.vocab_size, (5,), seed=15)[0]
    assert int4_calls(model, prompt) == 4 * model.config.num_hidden_layers + 1  # q/k/v and gate/up joined
    assert resident_bytes_of(model) == plan.weights  # the joined weights hold no second copy
