"""DeepSeek-V4's DSpark draft stages run as a block drafter (``engine.mtp``): the target's features are the
stream means entering the named layers; a block's base logits, Markov-biased drafts and confidences match a
float64 reference written here from the tensors (window-cut context, bidirectional block, sinks, the stages'
own MoE, the head); greedy transcripts with the drafter equal plain greedy (chunked or not, solo or batched,
several depths, scheduled); bad settings name their key."""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from dgpp.engine.block_draft import BlockDraftDecoder
from dgpp.engine.runner import ModelRunner
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.engine.work import SeqWork
from dgpp.family import LoadContext
from dgpp.plugin_api import CheckpointError, ConfigError, EngineConfig
from dgpp.plugins import build_manager, manager
from dgpp.startup.loading import load_context, load_model, read_hf_config
from dgpp.startup.memory_plan import plan_for
from dgpp.startup.speculative_build import build_speculative
from dgpp.step.pools import CachePools
from dgpp.testing.block_draft import (
    check_blocks,
    check_drafted_together_equals_alone,
    check_exact_with_drafts,
    prefill_features,
    serve_greedy,
)
from dgpp_deepseek.dspark import DSparkConfig, DSparkDrafter
from dgpp_deepseek.testing import add_dspark_stages, build_tiny_deepseek_v4

BS, BLOCKS, BLOCK, TARGETS = 4, 128, 4, (1, 2, 3)
_GEN = torch.Generator().manual_seed(17)
_SHARED = torch.randint(3, 120, (12,), generator=_GEN).tolist()
PROMPTS = [torch.randint(3, 120, (n,), generator=_GEN).tolist() for n in (5, 11, 17)] + [
    _SHARED + [7, 8],
    _SHARED + [9, 10, 11],
]
MAX_TOKENS = [14, 10, 12, 9, 11]


def _with_drafter(path):
    model = load_model(path)
    hf = read_hf_config(path)
    drafter = manager().hook.dgpp_build_draft(
        ctx=LoadContext(path, hf, "deepseek", "DeepseekV4ForCausalLM"), model=model
    )
    assert isinstance(drafter, DSparkDrafter)
    return path, model, drafter


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    """Stages whose Markov head leans on repeating the last token: blocks stand where the model repeats."""
    path = build_tiny_deepseek_v4(tmp_path_factory.mktemp("dspark"), seed=3)
    return _with_drafter(add_dspark_stages(path, block_size=BLOCK, target_layer_ids=TARGETS, seed=4))


@pytest.fixture(scope="module")
def dsv4_free(tmp_path_factory):
    """Stages with a plain random Markov head: every draft follows the block's own logits."""
    path = build_tiny_deepseek_v4(tmp_path_factory.mktemp("dspark_free"), seed=3)
    return _with_drafter(
        add_dspark_stages(path, block_size=BLOCK, target_layer_ids=TARGETS, repeat_bias=0, seed=6)
    )


# ---- the float64 reference ------------------------------------------------------------------------
class Reference:
    """The DSpark draft in float64 from the checkpoint's tensors, as DeepSeek's DSpark block computes it."""

    def __init__(self, path) -> None:
        self.cfg = json.loads((path / "config.json").read_text())
        self.w = {
            k: v.double() for k, v in load_file(path / "model.safetensors").items() if v.is_floating_point()
        }
        c = self.cfg
        self.eps, self.hc_eps = c.get("rms_norm_eps", 1e-6), c.get("hc_eps", 1e-6)
        self.heads, self.dim, self.rope_dim = c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
        self.stages = c["num_nextn_predict_layers"]

    def rms(self, x, weight=None):
        y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return y if weight is None else y * weight

    def rope(self, x, positions, inverse=False):
        """Interleaved pairs of the last ``rope`` dims, turned by ``position * theta ** (-2i / rope)``."""
        theta = self.cfg["rope_theta"]
        rope = self.rope_dim
        freqs = positions.double()[:, None] / theta ** (torch.arange(0, rope, 2).double() / rope)
        cos, sin = freqs.cos(), freqs.sin() * (-1 if inverse else 1)
        while cos.dim() < x.dim():
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        head, tail = x[..., :-rope], x[..., -rope:]
        even, odd = tail[..., 0::2], tail[..., 1::2]
        turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        return torch.cat([head, turned], dim=-1)

    def mixes(self, streams, fn):
        flat = self.rms(streams.reshape(streams.shape[0], -1))
        return flat @ fn.T

    def hc(self, streams, p, site):
        n = streams.shape[1]
        fn, base, scale = (self.w[f"{p}hc_{site}_{k}"] for k in ("fn", "base", "scale"))
        m = self.mixes(streams, fn)
        pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + self.hc_eps
        post = 2 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
        comb = torch.softmax((m[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        for _ in range(self.cfg.get("hc_sinkhorn_iters", 20) - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.hc_eps)
        return (pre[:, :, None] * streams).sum(1), post, comb

    @staticmethod
    def expand(streams, out, post, comb):
        return post[:, :, None] * out[:, None, :] + torch.einsum("tjk,tjh->tkh", comb, streams)

    def main_x(self, features):
        return self.rms(
            features.double() @ self.w["mtp.0.main_proj.weight"].T, self.w["mtp.0.main_norm.weight"]
        )

    def latent(self, x, p, positions):
        return self.rope(
            self.rms(x @ self.w[f"{p}attn.wkv.weight"].T, self.w[f"{p}attn.kv_norm.weight"]), positions
        )

    def attention(self, x, p, positions, context):
        w = self.w
        q = (
            self.rms(x @ w[f"{p}attn.wq_a.weight"].T, w[f"{p}attn.q_norm.weight"])
            @ w[f"{p}attn.wq_b.weight"].T
        )
        q = self.rope(self.rms(q.view(-1, self.heads, self.dim)), positions)
        keys = torch.cat([context, self.latent(x, p, positions)])  # the whole block, both ways
        scores = torch.einsum("rhd,kd->rhk", q, keys) / math.sqrt(self.dim)
        sink = w[f"{p}attn.attn_sink"][None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = self.rope(torch.einsum("rhk,kd->rhd", probs, keys), positions, inverse=True)
        groups, rank = self.cfg["o_groups"], self.cfg["o_lora_rank"]
        per_group = out.reshape(out.shape[0], groups, -1)
        wo_a = w[f"{p}attn.wo_a.weight"]
        mixed = torch.cat(
            [per_group[:, g] @ wo_a[g * rank : (g + 1) * rank].T for g in range(groups)], dim=-1
        )
        return mixed @ w[f"{p}attn.wo_b.weight"].T

    def swiglu(self, x, prefix):
        limit = self.cfg.get("swiglu_limit", 10.0)
        gate = (x @ self.w[prefix + "w1.weight"].T).clamp(max=limit)
        up = (x @ self.w[prefix + "w3.weight"].T).clamp(-limit, limit)
        return (torch.nn.functional.silu(gate) * up) @ self.w[prefix + "w2.weight"].T

    def moe(self, x, p):
        scores = torch.sqrt(torch.nn.functional.softplus(x @ self.w[f"{p}ffn.gate.weight"].T))
        k = min(self.cfg["num_experts_per_tok"], scores.shape[1])
        ids = (scores + self.w[f"{p}ffn.gate.bias"]).topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.cfg.get("routed_scaling_factor", 1.5)
        out = self.swiglu(x, f"{p}ffn.shared_experts.")
        for row in range(x.shape[0]):
            for e, wt in zip(ids[row].tolist(), weights[row], strict=True):
                out[row] = out[row] + wt * self.swiglu(x[row : row + 1], f"{p}ffn.experts.{e}.")[0]
        return out

    def block(self, features, c, anchor):
        """Base logits, collapsed streams, drafts and confidences of the block at ``c`` after the context whose
        target features are ``features`` (rows 0 .. c - 1)."""
        block, window = self.cfg["dspark_block_size"], self.cfg["sliding_window"]
        positions = torch.arange(c, c + block)
        tokens = torch.tensor([anchor] + [self.cfg["dspark_noise_token_id"]] * (block - 1))
        main_x = self.main_x(features[max(0, c - window) : c])
        ctx_positions = torch.arange(max(0, c - window), c)
        streams = self.w["embed.weight"][tokens][:, None, :].expand(-1, self.cfg["hc_mult"], -1)
        for s in range(self.stages):
            p = f"mtp.{s}."
            x, post, comb = self.hc(streams, p, "attn")
            att = self.attention(
                self.rms(x, self.w[p + "attn_norm.weight"]),
                p,
                positions,
                self.latent(main_x, p, ctx_positions),
            )
            streams = self.expand(streams, att, post, comb)
            x, post, comb = self.hc(streams, p, "ffn")
            streams = self.expand(
                streams, self.moe(self.rms(x, self.w[p + "ffn_norm.weight"]), p), post, comb
            )
        last = f"mtp.{self.stages - 1}."
        pre = (
            torch.sigmoid(
                self.mixes(streams, self.w[last + "hc_head_fn"]) * self.w[last + "hc_head_scale"]
                + self.w[last + "hc_head_base"]
            )
            + self.hc_eps
        )
        collapsed = (pre[:, :, None] * streams).sum(1)
        base = self.rms(collapsed, self.w[last + "norm.weight"]) @ self.w["head.weight"].T
        w1, w2 = self.w[last + "markov_head.markov_w1.weight"], self.w[last + "markov_head.markov_w2.weight"]
        proj = self.w[last + "confidence_head.proj.weight"][0]
        prev, drafts, confidence = anchor, [], []
        for k in range(block):
            e = w1[prev]
            confidence.append(torch.sigmoid(torch.cat([collapsed[k], e]) @ proj))
            prev = int(torch.argmax(base[k] + e @ w2.T))
            drafts.append(prev)
        return base, collapsed, drafts, torch.stack(confidence)


def _prefill_features(model, drafter, prompts):
    """Each prompt prefilled by the target, then written into the drafter's context (tables with room for a
    block and the bonus token)."""
    return prefill_features(model, drafter, prompts, blocks=BLOCKS, block_size=BS, spare=BLOCK + 1)


def test_blocks_drafted_together_equal_each_drafted_alone(dsv4_free):
    """One masked attention over the batch: contexts cut by the window (17, 11 tokens), shorter (5) and of two
    tokens give each request the drafts and confidences of its block drafted alone."""
    _, model, drafter = dsv4_free
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[0][:2]]
    check_drafted_together_equals_alone(model, drafter, prompts, [41, 77, 5, 9], blocks=BLOCKS, block_size=BS)


def test_features_are_the_mean_of_the_streams_entering_the_target_layers(dsv4):
    _, model, _ = dsv4
    seen = {}
    hooks = [
        model.layers[i].register_forward_pre_hook(
            lambda m, args, i=i: seen.__setitem__(i, args[0].mean(dim=1))
        )
        for i in TARGETS
    ]
    pools = CachePools(model.cache_spec(), BLOCKS, BS, 2)
    model.keep_hidden = True
    try:
        ModelRunner(model, pools).step([SeqWork(0, [0, 1, 2], 0, PROMPTS[1])])
        features = model.last_hidden
    finally:
        model.keep_hidden = False
        for h in hooks:
            h.remove()
    assert torch.equal(features, torch.cat([seen[i] for i in TARGETS], dim=-1))


def test_block_matches_the_float64_reference(dsv4_free):
    """Two requests drafted in one call: one with a context longer than the window (cut), one shorter."""
    path, model, drafter = dsv4_free
    # 17 tokens (past the window of 6: cut) and 5; the window and the block matter (a stale context moves them)
    check_blocks(
        model,
        drafter,
        [PROMPTS[2], PROMPTS[0]],
        [41, 77],
        Reference(path).block,
        blocks=BLOCKS,
        block_size=BS,
    )


serve = functools.partial(serve_greedy, prompts=PROMPTS, max_tokens=MAX_TOKENS, blocks=BLOCKS, block_size=BS)


@pytest.fixture(scope="module")
def plain(dsv4):
    _, model, _ = dsv4
    return {chunk: serve(model, chunk=chunk)[0] for chunk in (4, 64)}


@pytest.mark.parametrize(
    ("depth", "chunk", "concurrency"), [(1, 8, 3), (2, 4, 1), (4, 64, 3), (3, 4, 3), (4, 8, 1)]
)
def test_greedy_with_dspark_equals_plain_greedy(dsv4, plain, depth, chunk, concurrency):
    _, model, drafter = dsv4
    out, sched = serve(model, drafter, depth, chunk=chunk, concurrency=concurrency)
    check_exact_with_drafts(out, plain[4], sched)


@pytest.mark.parametrize(("right", "chunk", "concurrency"), [(BLOCK, 8, 3), (2, 4, 3), (3, 64, 1)])
def test_deep_blocks_that_stand_keep_greedy_exact(dsv4, plain, right, chunk, concurrency):
    """Blocks right up to ``right`` drafts: several drafts stand per pass (many context rows written at once, the
    hybrid state re-run after a partial block) and the transcript is still the plain one."""
    _, model, drafter = dsv4
    out, sched = serve(model, drafter, BLOCK, chunk=chunk, concurrency=concurrency, oracle=(plain[4], right))
    check_exact_with_drafts(out, plain[4], sched, right)


def test_plain_greedy_does_not_depend_on_the_chunk(plain):
    assert plain[4] == plain[64]


def test_scheduled_dspark_equals_plain_greedy(dsv4, plain):
    _, model, drafter = dsv4
    schedule = ScheduleSettings(row_ms=2.0, base_ms=10.0, adapt=False)
    out, sched = serve(model, drafter, 4, schedule=schedule)
    assert out == plain[4]
    assert sched.speculative.stats.num_draft_tokens_total > 0


def test_depth_beyond_the_block_is_refused(dsv4):
    _, model, drafter = dsv4
    runner = ModelRunner(model, CachePools(model.cache_spec(), BLOCKS, BS, 4))
    with pytest.raises(ValueError, match="engine.mtp_depth 5 exceeds the 4 drafts"):
        BlockDraftDecoder(runner, drafter, BLOCK + 1)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"dspark_block_size": None}, "dspark_block_size"),
        ({"dspark_block_size": 0}, "dspark_block_size"),
        ({"dspark_noise_token_id": 10_000}, "dspark_noise_token_id"),
        ({"dspark_target_layer_ids": [1, 1]}, "dspark_target_layer_ids"),
        ({"dspark_target_layer_ids": [9]}, "dspark_target_layer_ids"),
    ],
)
def test_bad_dspark_keys_name_the_key(dsv4, change, key):
    path, model, _ = dsv4
    hf = {**read_hf_config(path), **change}
    with pytest.raises(CheckpointError, match=key):
        DSparkConfig.from_hf_config(hf, model.config)


def test_a_main_projection_that_reads_other_layers_is_refused(dsv4):
    _, model, _ = dsv4
    with pytest.raises(CheckpointError, match="main_proj reads 192 features"):
        DSparkDrafter(model, DSparkConfig(BLOCK, 5, (1, 2)))


def test_a_checkpoint_without_dspark_keys_has_no_drafter(dsv4):
    path, model, _ = dsv4
    hf = {k: v for k, v in read_hf_config(path).items() if not k.startswith("dspark_")}
    assert DSparkConfig.from_hf_config(hf, model.config) is None


def test_the_plan_counts_the_context_rows_with_mtp_on(dsv4):
    path, model, drafter = dsv4
    pm = build_manager()
    plain = plan_for(pm, load_context(path, pm=pm))
    spec = plan_for(pm, load_context(path, EngineConfig(mtp=True, mtp_depth=2), pm=pm))
    stages = len(drafter.stages)
    assert (
        spec.kv_per_token - plain.kv_per_token == stages * model.config.head_dim * 4
    )  # one fp32 latent each


def test_the_startup_builds_a_block_decoder_and_refuses_a_depth_past_the_block(dsv4):
    path, model, _ = dsv4
    runner = ModelRunner(model, CachePools(model.cache_spec(), BLOCKS, BS, 4))
    hf = read_hf_config(path)

    def build(depth: int):
        engine = EngineConfig(mtp=True, mtp_depth=depth)
        ctx = LoadContext(path, hf, "deepseek", "DeepseekV4ForCausalLM", engine=engine)
        return build_speculative(engine, ctx, runner, pm=manager())

    decoder = build(BLOCK)
    assert isinstance(decoder, BlockDraftDecoder) and decoder.depth == BLOCK
    with pytest.raises(ConfigError, match="engine.mtp_depth: 5 exceeds the 4 drafts"):
        build(BLOCK + 1)
    model.keep_hidden = False
