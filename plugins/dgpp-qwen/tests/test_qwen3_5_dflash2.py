"""The DFlash2 block drafter for the Qwen3.5 text models (``engine.mtp`` with ``engine.dflash_model``): the target's
features are the named layers' outputs; a block's mask rows, candidate walk and confidences match a float64
reference written here from the two checkpoints' tensors (windowed context, bidirectional block, the 2-tap
grouped convolutions, the selector); greedy transcripts with the drafter equal plain greedy (chunked or not,
solo or batched, several depths, scheduled); a missing or wrong drafter directory names the key or file."""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dgpp.engine.runner import ModelRunner, build_batch
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.engine.work import SeqWork
from dgpp.family import LoadContext
from dgpp.plugin_api import CheckpointError, ConfigError, EngineConfig
from dgpp.plugins import manager
from dgpp.startup.loading import load_model, read_hf_config
from dgpp.step.pools import CachePools
from dgpp.testing.block_draft import check_drafted_together_equals_alone, prefill_features, serve_greedy
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp_qwen.dflash2 import DFlash2Drafter
from dgpp_qwen.testing_dflash2 import build_tiny_dflash2

BS, BLOCKS, VOCAB, TAPS = 4, 160, 48, (1, 3)
_GEN = torch.Generator().manual_seed(29)
_SHARED = torch.randint(2, VOCAB - 1, (12,), generator=_GEN).tolist()
PROMPTS = [torch.randint(2, VOCAB - 1, (n,), generator=_GEN).tolist() for n in (5, 11, 17)] + [
    _SHARED + [7, 8],
    _SHARED + [9, 10, 11],
]
MAX_TOKENS = [14, 10, 12, 9, 11]


def _drafter(target, drafter_dir, model=None):
    model = model or load_model(target)
    engine = EngineConfig(mtp=True, dflash_model=str(drafter_dir))
    ctx = LoadContext(target, read_hf_config(target), "qwen", "Qwen3_5ForCausalLM", engine=engine)
    return model, manager().hook.dgpp_build_draft(ctx=ctx, model=model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2")
    target = build_tiny_checkpoint("qwen3_5", root / "target", seed=31, overrides={"vocab_size": VOCAB})
    drafter_dir = build_tiny_dflash2(root / "drafter", target, target_layer_ids=TAPS, seed=32)
    model, drafter = _drafter(target, drafter_dir)
    assert isinstance(drafter, DFlash2Drafter)
    return target, drafter_dir, model, drafter


# ---- the float64 reference ------------------------------------------------------------------------
class Reference:
    """The DFlash2 draft in float64 from the drafter's and the target's tensors."""

    def __init__(self, target, drafter_dir) -> None:
        self.cfg = json.loads((drafter_dir / "config.json").read_text())
        self.d = self.cfg["dflash_config"]
        self.w = {k: v.double() for k, v in load_file(drafter_dir / "model.safetensors").items()}
        t = load_file(target / "model.safetensors")
        self.embed, self.head = t["model.embed_tokens.weight"].double(), t["lm_head.weight"].double()
        self.eps = self.cfg["rms_norm_eps"]

    def rms(self, x, weight):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * weight

    def rope(self, x, positions):
        dim = x.shape[-1]
        freqs = positions.double()[:, None] / self.cfg["rope_parameters"]["rope_theta"] ** (
            torch.arange(0, dim, 2).double() / dim
        )
        cos, sin = torch.cat([freqs.cos()] * 2, -1)[:, None], torch.cat([freqs.sin()] * 2, -1)[:, None]
        return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin

    def project(self, x, p, name, heads, positions):
        out = (x @ self.w[f"{p}self_attn.{name}_proj.weight"].T).view(x.shape[0], heads, -1)
        return self.rope(self.rms(out, self.w[f"{p}self_attn.{name}_norm.weight"]), positions)

    def conv(self, x, delta, base, side):
        """out[r, c] = sum_t (base[side, t, c] + delta[r, side, t, c // group]) * x[r - t, c], r - t in the block."""
        taps, group = base.shape[1], self.d["conv_group_size"]
        delta = delta.view(x.shape[0], 2, taps, -1)
        out = torch.zeros_like(x)
        for r in range(x.shape[0]):
            for t in range(min(taps, r + 1)):
                coef = base[side, t] + delta[r, side, t].repeat_interleave(group)
                out[r] = out[r] + coef * x[r - t]
        return out

    def block(self, features, c, anchor):
        """The mask rows' logits, the drafts and their confidences of the block at ``c``."""
        cfg, w, block = self.cfg, self.w, self.d["block_size"]
        heads, kv_heads, window = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["sliding_window"],
        )
        fused = self.rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
        ctx_pos, positions = torch.arange(c), torch.arange(c, c + block)
        resid = self.embed[torch.tensor([anchor] + [self.d["mask_token_id"]] * (block - 1))]
        for n in range(cfg["num_hidden_layers"]):
            p = f"layers.{n}."
            ctx_k = self.project(fused[:c], p, "k", kv_heads, ctx_pos)
            ctx_v = (fused[:c] @ w[p + "self_attn.v_proj.weight"].T).view(c, kv_heads, -1)
            x = self.rms(resid, w[p + "input_layernorm.weight"])
            delta = x @ w[p + "attention_conv.kernel_projection.weight"].T
            xc = self.conv(x, delta, w[p + "attention_conv.base_kernel"], 0)
            q = self.project(xc, p, "q", heads, positions)
            k = torch.cat([ctx_k, self.project(xc, p, "k", kv_heads, positions)])
            v = torch.cat([ctx_v, (xc @ w[p + "self_attn.v_proj.weight"].T).view(block, kv_heads, -1)])
            rep = heads // kv_heads
            scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / q.shape[-1] ** 0.5
            far = (positions[:, None] - ctx_pos[None, :]) >= window  # the context outside each row's window
            scores[:, :, :c] = scores[:, :, :c].masked_fill(far, float("-inf"))
            att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(rep, 1)).reshape(
                block, -1
            )
            o = att @ w[p + "self_attn.o_proj.weight"].T
            resid = resid + self.conv(o, delta, w[p + "attention_conv.base_kernel"], 1)
            x = self.rms(resid, w[p + "post_attention_layernorm.weight"])
            delta = x @ w[p + "mlp_conv.kernel_projection.weight"].T
            xc = self.conv(x, delta, w[p + "mlp_conv.base_kernel"], 0)
            mlp = (F.silu(xc @ w[p + "mlp.gate_proj.weight"].T) * (xc @ w[p + "mlp.up_proj.weight"].T)) @ w[
                p + "mlp.down_proj.weight"
            ].T
            resid = resid + self.conv(mlp, delta, w[p + "mlp_conv.base_kernel"], 1)
        h = self.rms(resid[1:], w["norm.weight"])
        logits = h @ self.head.T
        gate = h @ w["candidate_selector.hidden_projection.weight"].T
        pred, succ = w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"]
        prev, drafts, confidence = anchor, [], []
        for step in range(block - 1):
            ranked = sorted(range(logits.shape[1]), key=lambda i: (-float(logits[step, i]), i))
            candidates = ranked[: self.d["selector_top_k"]]
            scores = [float(logits[step, i] + (pred[prev] * gate[step] * succ[i]).sum()) for i in candidates]
            prev = candidates[max(range(len(scores)), key=lambda j: (scores[j], -j))]
            drafts.append(prev)
            confidence.append(float(logits[step].softmax(-1)[prev]))
        return logits, drafts, torch.tensor(confidence, dtype=torch.float64)


def _context(model, drafter, prompts):
    return prefill_features(model, drafter, prompts, blocks=BLOCKS, block_size=BS, spare=8)


def test_features_are_the_outputs_of_the_tapped_layers(pair):
    _, _, model, _ = pair
    seen = {}

    def tap(i: int, run):
        # a layer's output is its stream plus its last sublayer's output (the stack adds them in the next norm)
        def sublayers(normed, residual, batch):
            out, stream = run(normed, residual, batch)
            seen[i] = stream + out
            return out, stream

        return sublayers

    for i in TAPS:
        model.model.layers[i].sublayers = tap(i, model.model.layers[i].sublayers)
    model.keep_hidden = True
    try:
        ModelRunner(model, CachePools(model.cache_spec(), BLOCKS, BS, 2)).step(
            [SeqWork(0, [0, 1, 2], 0, PROMPTS[1])]
        )
        features = model.last_hidden
    finally:
        model.keep_hidden = False
        for i in TAPS:
            del model.model.layers[i].sublayers
    assert torch.equal(features, torch.cat([seen[i] for i in TAPS], dim=-1))


def test_block_matches_the_float64_reference(pair):
    """Two requests in one call: a context longer than the window (8) and a shorter one."""
    target, drafter_dir, model, drafter = pair
    prompts, anchors = [PROMPTS[2], PROMPTS[0]], [13, 21]
    draft_pools, tables, features = _context(model, drafter, prompts)
    works = [SeqWork(i, tables[i], len(p), [anchors[i]]) for i, p in enumerate(prompts)]
    hidden, _ = drafter.mask_rows(build_batch(works, draft_pools))
    logits = model.compute_logits(hidden.reshape(-1, hidden.shape[-1])).view(2, hidden.shape[1], -1)
    drafts, confidence = drafter.draft(build_batch(works, draft_pools))
    ref = Reference(target, drafter_dir)
    for i, prompt in enumerate(prompts):
        r_logits, r_drafts, r_conf = ref.block(features[i], len(prompt), anchors[i])
        assert (logits[i].double() - r_logits).abs().max() < 1e-4
        assert drafts[i].tolist() == r_drafts
        assert (confidence[i].double() - r_conf).abs().max() < 1e-4
    # the selector moves the picks: without it they would be each row's top logit
    tops = [r.argmax(-1).tolist() for r in logits]
    assert tops != drafts.tolist()


def test_blocks_drafted_together_equal_each_drafted_alone(pair):
    """One masked attention over the batch: contexts cut by the window (17, 11 tokens), shorter (5) and of two
    tokens give each request the drafts and confidences of its block drafted alone."""
    _, _, model, drafter = pair
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[0], PROMPTS[0][:2]]
    check_drafted_together_equals_alone(model, drafter, prompts, [13, 21, 5, 9], blocks=BLOCKS, block_size=BS)


serve = functools.partial(serve_greedy, prompts=PROMPTS, max_tokens=MAX_TOKENS, blocks=BLOCKS, block_size=BS)


@pytest.fixture(scope="module")
def plain(pair):
    _, _, model, _ = pair
    return {chunk: serve(model, chunk=chunk)[0] for chunk in (4, 64)}


@pytest.mark.parametrize(("depth", "chunk", "concurrency"), [(1, 8, 3), (2, 4, 1), (4, 64, 3), (3, 4, 3)])
def test_greedy_with_dflash2_equals_plain_greedy(pair, plain, depth, chunk, concurrency):
    _, _, model, drafter = pair
    out, sched = serve(model, drafter, depth, chunk=chunk, concurrency=concurrency)
    assert out == plain[4] == plain[64]
    stats = sched.speculative.stats
    assert stats.num_draft_tokens_total > 0 and stats.num_accepted_tokens_total > 0


def test_scheduled_dflash2_equals_plain_greedy(pair, plain):
    _, _, model, drafter = pair
    out, sched = serve(model, drafter, 4, schedule=ScheduleSettings(row_ms=2.0, base_ms=10.0, adapt=False))
    assert out == plain[4]


@pytest.fixture(scope="module")
def long_block(pair, tmp_path_factory):
    """A drafter whose 10-row block proposes 9 drafts, past the 5 a chained MTP drafter verifies."""
    target, _, model, _ = pair
    drafter_dir = build_tiny_dflash2(
        tmp_path_factory.mktemp("dflash2_long") / "drafter",
        target,
        target_layer_ids=TAPS,
        seed=33,
        block_size=10,
        sliding_window=12,
    )
    return drafter_dir, _drafter(target, drafter_dir, model)[1]


@pytest.mark.parametrize(("depth", "chunk", "concurrency"), [(9, 4, 3), (7, 64, 1)])
def test_verifies_deeper_than_five_equal_plain_greedy(pair, plain, long_block, depth, chunk, concurrency):
    _, _, model, _ = pair
    _, drafter = long_block
    assert drafter.drafts == 9
    out, sched = serve(model, drafter, depth, chunk=chunk, concurrency=concurrency)
    assert out == plain[4]
    verifies = sched.speculative.stats.verifies_per_depth
    assert sum(verifies[6:]) > 0, verifies  # steps that judged more than 5 drafts ran


def test_a_depth_past_the_block_names_the_key(pair, long_block):
    from dgpp.plugins import build_manager
    from dgpp.startup.speculative_build import build_speculative

    target, _, model, _ = pair
    drafter_dir, _ = long_block
    pm = build_manager()
    runner = ModelRunner(model, CachePools(model.cache_spec(), 8, BS, 2))
    engine = EngineConfig(mtp=True, mtp_depth=9, dflash_model=str(drafter_dir))
    ctx = LoadContext(target, read_hf_config(target), "qwen", "Qwen3_5ForCausalLM", engine=engine)
    assert build_speculative(engine, ctx, runner, pm=pm).depth == 9
    engine = EngineConfig(mtp=True, mtp_depth=10, dflash_model=str(drafter_dir))
    ctx = LoadContext(target, read_hf_config(target), "qwen", "Qwen3_5ForCausalLM", engine=engine)
    with pytest.raises(ConfigError, match="engine.mtp_depth: 10 exceeds the 9 drafts"):
        build_speculative(engine, ctx, runner, pm=pm)
    model.keep_hidden = False


def test_a_missing_directory_names_the_key(pair, tmp_path):
    target, _, model, _ = pair
    with pytest.raises(ConfigError, match="engine.dflash_model: .* is not a directory"):
        _drafter(target, tmp_path / "nowhere", model)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda c, t: c.update(architectures=["DFlashDraftModel"]),
            "'architectures' must name DFlash2DraftModel",
        ),
        (lambda c, t: c["dflash_config"].pop("mask_token_id"), "'dflash_config.mask_token_id' is missing"),
        (lambda c, t: c["dflash_config"].update(target_layer_ids=[1, 9]), r"target_layer_ids' \[9\]"),
        (lambda c, t: c.update(hidden_size=32), "'hidden_size' 32 is not the target's 64"),
        (lambda c, t: t.pop("fc.weight"), "has no tensor 'fc.weight'"),
        (lambda c, t: t.update({"norm.weight": torch.ones(3)}), r"'norm.weight' is \[3\], expected \[64\]"),
    ],
)
def test_a_wrong_drafter_names_the_file_and_key(pair, tmp_path, edit, match):
    target, drafter_dir, model, _ = pair
    bad = tmp_path / "drafter"
    shutil.copytree(drafter_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    tensors = load_file(bad / "model.safetensors")
    edit(config, tensors)
    (bad / "config.json").write_text(json.dumps(config))
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError, match=match):
        _drafter(target, bad, model)


def test_the_key_needs_mtp():
    from dgpp.config import parse_config

    with pytest.raises(ConfigError, match="engine.dflash_model: its drafter drafts under engine.mtp"):
        parse_config({"model": "m", "engine": {"dflash_model": "/somewhere"}})
    assert (
        parse_config({"model": "m", "engine": {"mtp": True, "dflash_model": "/x"}}).engine.dflash_model
        == "/x"
    )


def test_the_plan_counts_the_drafter_and_its_context(pair):
    from dgpp.plugins import build_manager
    from dgpp.startup.loading import load_context
    from dgpp.startup.memory_plan import plan_for

    target, drafter_dir, _, drafter = pair
    pm = build_manager()
    plain = plan_for(pm, load_context(target, pm=pm))
    engine = EngineConfig(mtp=True, mtp_depth=2, dflash_model=str(drafter_dir))
    spec = plan_for(pm, load_context(target, engine, pm=pm))
    cfg = drafter.cfg
    assert spec.drafter == sum(t.numel() * t.element_size() for t in drafter.w.values())
    assert (
        spec.kv_per_token - plain.kv_per_token
        == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    )
