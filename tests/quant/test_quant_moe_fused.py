"""Packed experts through the fused grouped GEMM (Triton interpreter) against the per-expert decode reference."""

from __future__ import annotations

import pytest
import torch

from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.kernels import moe_block_probe
from dgpp.quant.kernels.moe_launch import DECODE_BM, MoETiles, fused_quant_moe
from dgpp.quant.moe import QuantExperts

FORMATS = [
    FP8Block(block=(128, 128)),
    FP8Block(block=(32, 32), scale_format="e8m0"),
    FP8Block(block=(16, 16), scale_format="bf16"),
    FP8Channel(),
    NVFP4ModelOpt(),
    NVFP4CompressedTensors(),
    MXFP4(),
    IntPacked(bits=4, group=64),
    IntPacked(bits=8, group=32),
    GPTQ(bits=4, group=64),
]
IDS = [f"{f.name}-{i}" for i, f in enumerate(FORMATS)]
HIDDEN, INTER, EXPERTS = 128, 64, 8


@pytest.fixture(autouse=True)
def _probe_on_80_tokens(monkeypatch):
    """The expert block probe on 80 tokens (a full 64-row block and a partial one a form) on one group of experts:
    the same checks at a fraction of the interpreter's time."""
    monkeypatch.setattr(moe_block_probe, "PROBE_TOKENS", 80)
    monkeypatch.setattr(moe_block_probe, "PROBE_GROUPS", 1)


def test_the_probe_routes_token_groups_to_distinct_experts(monkeypatch):
    """Each group of probe tokens has its own top_k experts (so a prefill-sized probe streams more weights than a
    cache holds), and no group names an expert the layer lacks."""
    monkeypatch.setattr(moe_block_probe, "PROBE_GROUPS", 8)
    x, weights, ids = moe_block_probe.probe_inputs(32, 4, 256, torch.float32, torch.device("cpu"))
    assert x.shape == (8 * 80, 32) and ids.shape == weights.shape == (8 * 80, 4)
    assert torch.allclose(weights.sum(1), torch.ones(8 * 80))
    groups = ids.view(8, 80, 4)
    assert (groups == groups[:, :1]).all()  # a group's tokens share their experts
    assert groups[:, 0].flatten().unique().numel() == 32  # and no two groups share one
    _, _, few = moe_block_probe.probe_inputs(32, 4, 10, torch.float32, torch.device("cpu"))
    assert few.shape == (2 * 80, 4) and int(few.max()) == 7  # two groups fit ten experts


def build_experts(
    fmt, seed: int, experts: int = EXPERTS, hidden: int = HIDDEN, inter: int = INTER
) -> QuantExperts:
    """QuantExperts loaded through its weight loaders with freshly encoded random weights."""
    gen = torch.Generator().manual_seed(seed)
    moe = QuantExperts(fmt, experts, hidden, inter)
    for proj, shape in (
        ("gate_proj", (inter, hidden)),
        ("up_proj", (inter, hidden)),
        ("down_proj", (hidden, inter)),
    ):
        stack = getattr(moe, proj)
        for e in range(experts):
            shipped = encode(fmt, torch.randn(shape, generator=gen) * shape[1] ** -0.5)
            for suffix in stack.names:
                param = getattr(stack, suffix)
                param.weight_loader(param, shipped[suffix], e)
    return moe


def routing(tokens: int, top_k: int, seed: int, experts: int = EXPERTS) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_fused_equals_reference_fp32(fmt):
    moe = build_experts(fmt, seed=1)
    for tokens, top_k in ((1, 2), (5, 3), (40, 2)):  # 40 x 2 assignments take the 64-row prefill blocks
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        weights, ids = routing(tokens, top_k, seed=tokens)
        want = moe.forward_reference(x, weights, ids)
        moe.use_fused = True
        got = moe(x, weights, ids)
        moe.use_fused = None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _forbid_host_sync(patch: pytest.MonkeyPatch) -> None:
    """Make every way a CUDA tensor's value reaches the host raise (here on CPU tensors): reading a value
    (.item, .tolist, bool/int/float), or ops whose output shape depends on the data."""

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: {name}")

        return raise_

    for name in (
        "item",
        "tolist",
        "nonzero",
        "unique",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "numpy",
    ):
        patch.setattr(torch.Tensor, name, forbidden(f"Tensor.{name}"))
    for name in ("nonzero", "unique", "bincount", "masked_select", "argwhere", "unique_consecutive"):
        patch.setattr(torch, name, forbidden(f"torch.{name}"))
    real_where = torch.where
    patch.setattr(
        torch, "where", lambda cond, *rest: real_where(cond, *rest) if rest else forbidden("where")()
    )


def test_fused_path_never_reads_values_back(monkeypatch):
    """What makes the layer capturable: no value goes to the host and every shape follows from T, K, E.
    The reference, which loops over the picked experts, trips the same guard."""
    moe = build_experts(NVFP4ModelOpt(), seed=2)
    x = torch.randn(3, HIDDEN)
    weights, ids = routing(3, 2, seed=3)
    want = moe.forward_reference(x, weights, ids)
    moe.use_fused = True
    with monkeypatch.context() as patch:
        _forbid_host_sync(patch)
        got = moe(x, weights, ids)
        with pytest.raises(AssertionError, match="host sync"):
            moe.forward_reference(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_bf16_within_bf16_tolerance():
    """bf16 activations: weights decode to bf16 as the reference does; sums stay fp32 in the kernel. The
    interpreter truncates fp32 -> bf16 (a GPU rounds), so this is a loose check here (a few bf16 ulps);
    tests/perf/check_quant_moe.py measures the real error on the GPU."""
    moe = build_experts(NVFP4ModelOpt(), seed=4)
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    weights, ids = routing(6, 2, seed=6)
    weights = weights.to(torch.bfloat16)
    want = moe.forward_reference(x, weights, ids).float()
    moe.use_fused = True
    got = moe(x, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


NVFP4_EXPERTS_ONLY = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "exclude_modules": ["lm_head", "*self_attn*", "*linear_attn*", "*shared_expert*", "*mlp.gate"],
}


@pytest.fixture(scope="module")
def nvfp4_qwen3_5_moe(tmp_path_factory):
    """A tiny Qwen3.5-MoE checkpoint with NVFP4 (ModelOpt) experts, and its dequantized twin."""
    from dgpp.quant.checkpoints import dequantize_checkpoint, quantize_checkpoint
    from dgpp.testing.builders import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("qwen3_5_moe_nvfp4")
    quantized = quantize_checkpoint(
        build_tiny_checkpoint("qwen3_5_moe", root / "src", seed=12), root / "q", NVFP4_EXPERTS_ONLY
    )
    return quantized, dequantize_checkpoint(quantized, root / "dense")


def test_nvfp4_qwen3_5_moe_through_fused_experts_matches_transformers(nvfp4_qwen3_5_moe, monkeypatch):
    from dgpp.startup.loading import load_model
    from dgpp.testing import conformance as conf
    from dgpp.testing.builders import load_reference

    monkeypatch.setattr(QuantExperts, "use_fused", True)
    quantized, dense = nvfp4_qwen3_5_moe
    model, ref = load_model(quantized), load_reference(dense)
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert experts and all(m.fused(torch.zeros(1)) for m in experts)
    prompts = conf.make_prompts(model.info.vocab_size, (7, 19), seed=1)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4
    conf.check_greedy(model, ref, prompts, max_new_tokens=8)


def test_decode_graph_batch_through_fused_experts_equals_reference(nvfp4_qwen3_5_moe):
    """The padded static batch DecodeGraphs captures on CUDA (run eagerly here) goes through the fused
    experts, padding row included, and gives the logits of the eager step through the reference experts."""
    from dgpp.engine.graphs import DecodeGraphs
    from dgpp.engine.runner import ModelRunner, build_batch
    from dgpp.engine.work import SeqWork
    from dgpp.startup.loading import load_model
    from dgpp.step.pools import CachePools

    model = load_model(nvfp4_qwen3_5_moe[0])
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    pools = CachePools(
        model.cache_spec(), 3 * 4 + 2, 4, 6, torch.device("cpu")
    )  # slots 3..5: state snapshots
    tables = [list(range(i * 4, (i + 1) * 4)) for i in range(3)]
    prompts = torch.randint(
        0, model.info.vocab_size, (3, 6), generator=torch.Generator().manual_seed(0)
    ).tolist()
    runner = ModelRunner(model, pools)
    last = torch.argmax(
        runner.step([SeqWork(i, tables[i], 0, p) for i, p in enumerate(prompts)]), -1
    ).tolist()
    graphs = DecodeGraphs(model, pools, max_batch=4, max_blocks=4, capture=False)
    for step in range(2):
        work = [SeqWork(i, tables[i], 6 + step, [last[i]]) for i in range(3)]
        for i in range(3):
            pools.copy_state(i, i + 3)
        for m in experts:
            m.use_fused = True
        padded = graphs.run(build_batch(work, pools))  # 3 rows in the size-4 batch
        for m in experts:
            m.use_fused = False
        for i in range(3):  # the same step again from the same recurrent state (K/V rewrites are idempotent)
            pools.copy_state(i + 3, i)
        eager = runner.step(work)
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
        last = torch.argmax(eager, -1).tolist()


@pytest.mark.parametrize(
    "fmt", [FP8Block(block=(128, 128)), MXFP4(), GPTQ(bits=4, group=64)], ids=lambda f: f.name
)
def test_other_tiles_give_the_same_result(fmt):
    """The tile grid the GPU check sweeps: 64-row blocks for a decode batch, narrow columns, a K step
    of two scale groups; each computes the same values."""
    moe = build_experts(fmt, seed=7)
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(8))
    weights, ids = routing(4, 2, seed=9)
    want = moe.forward_reference(x, weights, ids)
    g, d = moe.gate_proj, moe.down_proj
    pack = 2 if isinstance(fmt, MXFP4) else 8 if isinstance(fmt, GPTQ) else 1
    for tiles in (MoETiles(bm=64, bn=16, bkp=128 // pack), MoETiles(bm=16, bn=64, bkp=256 // pack)):
        got = fused_quant_moe(
            (g.fmt, g.stacks(), moe.up_proj.stacks()), (d.fmt, d.stacks()), x, weights, ids, moe.inter, tiles
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "fmt", [MXFP4(), FP8Block(block=(128, 128), scale_format="e8m0")], ids=["mxfp4", "fp8-e8m0"]
)
def test_fused_clamped_swiglu_equals_reference(fmt):
    """DeepSeek-V4's experts (MXFP4) and shared-expert format with the SwiGLU clamp at 10: the fused kernel
    clamps as the per-expert reference does, and the clamp matters for these inputs."""
    moe = build_experts(fmt, seed=2)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9)) * 25
    weights, ids = routing(5, 2, seed=3)
    moe.swiglu_limit = 10.0
    want = moe.forward_reference(x, weights, ids)
    moe.use_fused = True
    got = moe(x, weights, ids)
    moe.swiglu_limit = None
    unclamped = moe(x, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 * float(want.abs().max()))
    assert (unclamped - want).abs().max() > 1e-2 * float(want.abs().max())


def down_rows(
    moe: QuantExperts, x: torch.Tensor, ids: torch.Tensor, tiles: MoETiles | None = None
) -> torch.Tensor:
    """The fused down projection alone, with fp32 output: one row per (token, expert) assignment, each row
    ``x[token] @ W_e^T`` (routing weight 1), in the tiles ``fused_quant_moe`` takes for this many assignments."""
    from dgpp.kernels.moe import align_to_experts
    from dgpp.quant.kernels.moe_launch import _launch, moe_tiles, stack_args

    down, (tokens, top_k) = moe.down_proj, ids.shape
    args = stack_args(down.fmt, down.stacks(), down.shape)
    n_assign = tokens * top_k
    tiles = tiles or moe_tiles(args["PACK"], n_assign, moe.num_experts)
    sorted_ids, block_expert = align_to_experts(ids, moe.num_experts, tiles.bm)
    rows = torch.zeros(sorted_ids.shape[0], x.shape[1], dtype=x.dtype)  # the GEMM reads its sorted rows
    used = sorted_ids < n_assign
    rows[used] = x[sorted_ids[used] // top_k]
    out = torch.zeros(n_assign, down.shape[0])
    _launch(
        args,
        None,
        rows,
        out,
        sorted_ids,
        block_expert,
        torch.ones(n_assign),
        n_assign,
        top_k,
        down.shape[0],
        tiles,
        gather=False,
        swiglu=False,
        scatter=True,
    )
    return out


@pytest.mark.parametrize("fmt", [NVFP4ModelOpt(), NVFP4CompressedTensors()], ids=["modelopt", "compressed"])
def test_fp4_expert_weights_exact_with_the_global_per_sum(fmt):
    """bf16 activations: an E2M1 code times its E4M3 group scale is exact in bf16, so the expert GEMM takes the
    format's exact weights and applies the global (ModelOpt's multiplier, compressed-tensors' divisor) to each
    fp32 sum. One projection with fp32 output equals an fp64 product of the exact weights to fp32 rounding;
    weights rounded to bf16 after the global (a per-weight decode) would be ~1e-3 off."""
    experts, top_k, tokens = 4, 2, 5
    moe = build_experts(fmt, seed=13, experts=experts, hidden=64, inter=256)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    _, ids = routing(tokens, top_k, seed=15, experts=experts)
    got = down_rows(moe, x, ids, MoETiles(bm=16, bn=32, bkp=64))
    exact = torch.stack([moe.expert_weight("down_proj", e, torch.float32) for e in range(experts)]).double()
    picked, inputs = exact[ids.flatten()], x.double().repeat_interleave(top_k, 0)
    want = torch.einsum("ak,ank->an", inputs, picked)
    rounded = torch.einsum("ak,ank->an", inputs, picked.bfloat16().double())
    scale = float(want.abs().max())
    assert float((got.double() - want).abs().max()) < 1e-5 * scale
    assert float((rounded - want).abs().max()) > 1e-4 * scale  # the weights' bf16 rounding is visible here


@pytest.mark.parametrize(
    "fmt",
    [NVFP4ModelOpt(), MXFP4(), IntPacked(bits=4, group=64), GPTQ(bits=4, group=64)],
    ids=["nvfp4", "mxfp4", "int4", "gptq-int4"],
)
def test_expert_rows_alone_equal_rows_in_a_batch(fmt):
    """bf16 packed experts: a token's fp32 expert rows do not depend on the tokens beside it, across batches that
    take 16-row and 64-row expert blocks (above 4 assignments per expert; the two block sizes must share a K
    step). Inputs span a wide exponent range, so the fp32 sums round and a K order that followed the batch
    would show."""
    moe = build_experts(fmt, seed=17, inter=256)
    gen = torch.Generator().manual_seed(18)
    x = (torch.randn(40, 256, generator=gen) * 2.0 ** torch.randint(-12, 13, (40, 256), generator=gen)).to(
        torch.bfloat16
    )
    _, ids = routing(40, 2, seed=19)
    alone = torch.cat([down_rows(moe, x[i : i + 1], ids[i : i + 1]) for i in range(40)])
    for tokens in (3, 17, 40):  # 40 x 2 assignments over 8 experts take the 64-row blocks
        assert torch.equal(down_rows(moe, x[:tokens], ids[:tokens]), alone[: 2 * tokens])


@pytest.mark.parametrize(
    "fmt", [IntPacked(bits=4, group=64), GPTQ(bits=4, group=64)], ids=["int4", "gptq-int4"]
)
def test_activations_in_step_order_give_the_column_reads_bits(fmt, monkeypatch):
    """Eight codes a word: x and the SwiGLU rows are written in step order first (``x_by_position``), and each
    code position's columns load as one run. The same values in the same dots: the bits of the column reads,
    at decode and prefill block sizes, with K (64 intermediate columns) shorter than one 128-column step."""
    from dgpp.quant.kernels import moe_launch

    moe = build_experts(fmt, seed=5)
    g, d = moe.gate_proj, moe.down_proj
    assert moe_launch._reads_step_order(
        moe_launch.stack_args(g.fmt, g.stacks(), (INTER, HIDDEN)), moe_launch.moe_tiles(8, 2, EXPERTS)
    )
    for tokens, top_k in ((1, 2), (5, 3), (40, 2)):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens + 20))
        weights, ids = routing(tokens, top_k, seed=tokens + 20)
        experts = ((g.fmt, g.stacks(), moe.up_proj.stacks()), (d.fmt, d.stacks()))
        ordered = fused_quant_moe(*experts, x, weights, ids, moe.inter)
        with monkeypatch.context() as patch:
            patch.setattr(moe_launch, "_reads_step_order", lambda args, tiles: False)
            columns = fused_quant_moe(*experts, x, weights, ids, moe.inter)
        assert torch.equal(ordered, columns)
        torch.testing.assert_close(ordered, moe.forward_reference(x, weights, ids), rtol=1e-5, atol=1e-5)


def block_form(tiles: MoETiles) -> str:
    """Which expert block form ``tiles`` is: the decode tile's 16-row blocks, one-dot or blocked 64-row blocks."""
    return "blocked" if tiles.row_blocks > 1 else "one_dot" if tiles.bm > DECODE_BM else "decode"


@pytest.mark.parametrize(
    "rounding_otherwise",
    [(), ("one_dot",), ("one_dot", "blocked")],
    ids=["all-exact", "one-dot-rounds-otherwise", "all-round-otherwise"],
)
def test_prefill_blocks_only_where_they_give_the_16_row_bits(rounding_otherwise, monkeypatch):
    """A prefill-sized routing takes 64-row expert blocks (one dot, else four 16-row dots on one decoded weight
    tile) only where a probe on this device found their rows bit-identical to the decode tile's 16-row blocks
    (Hopper issues wgmma for a one-dot 64-row block and mma for 16 rows); a device whose candidates round
    otherwise (simulated: their output moved by one ulp) gets the 16-row blocks' bits."""
    from dgpp.quant.kernels import moe_launch

    monkeypatch.setattr(moe_block_probe, "_CHOSEN", {})
    launch = moe_launch._launch

    def launch_rounding_otherwise(*args, **kwargs):
        launch(*args, **kwargs)
        out, tiles = args[3], args[10]
        if block_form(tiles) in rounding_otherwise:
            out.copy_(torch.nextafter(out, torch.full_like(out, float("inf"))))

    monkeypatch.setattr(moe_launch, "_launch", launch_rounding_otherwise)
    moe = build_experts(IntPacked(bits=4, group=64), seed=31)
    g, d = moe.gate_proj, moe.down_proj
    experts = ((g.fmt, g.stacks(), moe.up_proj.stacks()), (d.fmt, d.stacks()))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(32))
    weights, ids = routing(40, 2, seed=33)  # 80 assignments over 8 experts: above 4 an expert
    one_dot = moe_launch.moe_tiles(8, ids.numel(), EXPERTS)
    decode = moe_launch.moe_tiles(8, 0, EXPERTS)
    blocked = moe_launch.blocked_tiles(decode, one_dot)
    assert one_dot.bm == blocked.bm == 64 and blocked.row_blocks == 4 and decode.bm == moe_launch.DECODE_BM
    want_tiles = next(
        (t for t, kind in ((one_dot, "one_dot"), (blocked, "blocked")) if kind not in rounding_otherwise),
        decode,
    )
    got = fused_quant_moe(*experts, x, weights, ids, moe.inter)
    assert torch.equal(got, fused_quant_moe(*experts, x, weights, ids, moe.inter, want_tiles))
    assert list(moe_block_probe._CHOSEN.values()) == [want_tiles]
    if rounding_otherwise:  # the simulated rounding shows in the first candidate's output
        assert not torch.equal(got, fused_quant_moe(*experts, x, weights, ids, moe.inter, one_dot))


@pytest.mark.parametrize("fastest", ["one_dot", "blocked", "decode"])
def test_prefill_blocks_are_the_fastest_bit_identical_form(fastest, monkeypatch):
    """Of the forms whose rows get the 16-row bits (all of them here), a prefill-sized routing takes the fastest by
    the probe's timing, the 16-row blocks included: 64-row blocks that decode each weight once can still be slower
    (FP4 experts' blocked form on an H100). The timer is simulated: each form's time is set, the launches real."""
    from dgpp.quant.kernels import moe_launch

    monkeypatch.setattr(moe_block_probe, "_CHOSEN", {})
    launch, last = moe_launch._launch, []

    def recording_launch(*args, **kwargs):
        last.append(args[10])
        launch(*args, **kwargs)

    def timer(run, device) -> float:
        run()
        return 1.0 if block_form(last[-1]) == fastest else 2.0

    monkeypatch.setattr(moe_launch, "_launch", recording_launch)
    monkeypatch.setattr(moe_launch, "launch_time_us", timer)
    moe = build_experts(IntPacked(bits=4, group=64), seed=31)
    g, d = moe.gate_proj, moe.down_proj
    experts = ((g.fmt, g.stacks(), moe.up_proj.stacks()), (d.fmt, d.stacks()))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(32))
    weights, ids = routing(40, 2, seed=33)
    fused_quant_moe(*experts, x, weights, ids, moe.inter)
    (chosen,) = moe_block_probe._CHOSEN.values()
    assert block_form(chosen) == fastest
    last.clear()
    fused_quant_moe(*experts, x, weights, ids, moe.inter)  # probed once: the layer takes the chosen form
    assert last and all(block_form(t) == fastest for t in last)


@pytest.mark.parametrize(
    "fmt",
    [
        FP8Block(block=(128, 128)),
        NVFP4ModelOpt(),
        MXFP4(),
        IntPacked(bits=4, group=64),
        IntPacked(bits=8, group=32),
    ],
    ids=["fp8", "nvfp4", "mxfp4", "int4", "int8"],
)
def test_blocked_prefill_tiles_give_the_16_row_blocks_bits(fmt):
    """Four 16-row dots on one decoded weight tile (``blocked_tiles``): every row's bits are those of the decode
    tile's 16-row blocks, through both launches (gather + SwiGLU, scatter), with blocks partly filled and an
    expert holding more rows than one 64-row program. The test fails when a block's rows meet another block's
    activations or accumulator, or when a block is dropped."""
    from dgpp.quant.kernels import moe_launch

    moe = build_experts(fmt, seed=41, experts=4, inter=128)
    g, d = moe.gate_proj, moe.down_proj
    experts = ((g.fmt, g.stacks(), moe.up_proj.stacks()), (d.fmt, d.stacks()))
    gen = torch.Generator().manual_seed(42)
    x = (
        torch.randn(90, HIDDEN, generator=gen) * 2.0 ** torch.randint(-8, 9, (90, HIDDEN), generator=gen)
    ).to(torch.bfloat16)
    weights, ids = routing(90, 2, seed=43, experts=4)  # ~45 rows an expert, one expert above 64
    pack = moe_launch.stack_args(g.fmt, g.stacks(), (moe.inter, HIDDEN))["PACK"]
    decode = moe_launch.moe_tiles(pack, 0, 4)
    blocked = moe_launch.blocked_tiles(decode, moe_launch.moe_tiles(pack, ids.numel(), 4))
    want = fused_quant_moe(*experts, x, weights, ids, moe.inter, decode)
    assert torch.equal(fused_quant_moe(*experts, x, weights, ids, moe.inter, blocked), want)
    ref = moe.forward_reference(x, weights, ids).float()
    assert float((want.float() - ref).abs().max()) < 5e-2 * float(
        ref.abs().max()
    )  # bf16 roundings of large rows
