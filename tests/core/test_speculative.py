"""Speculative decoding (engine.mtp) through the scheduler: greedy with MTP on emits exactly the plain greedy
transcript (GLM-4.7 at depth 1 and 3, the Qwen3.5 dense hybrid at depth 2, MiMo-V2.6 at depth 1 and 2, GLM-5.3-Flash at
depth 1 to 3), an oracle drafter gets full
acceptance, a half-right one exercises the hybrid state restore, seeded sampling is reproducible, and the
``spec_decode`` counters move."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dgpp.engine.graphs import DecodeGraphs
from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import SpeculativeDecoder
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.family import LoadContext
from dgpp.plugins import manager
from dgpp.sample import ChoiceSampler, SamplingParams
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.published import Published
from dgpp.sched.request import SeqEvent, Sequence
from dgpp.sched.scheduler import Scheduler
from dgpp.serve.metrics import engine_report
from dgpp.startup.loading import load_context, load_model, read_hf_config
from dgpp.step.cache_spec import stored_as
from dgpp.step.pools import CachePools
from dgpp.testing.builders import build_tiny_checkpoint
from dgpp.testing.scheduler import scheduler_config
from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

BS, CHUNK, BLOCKS, VOCAB = 4, 8, 96, 512
# several lengths (chunked prefill: 8-token chunks), two sharing a 16-token prefix (a prefix-cache hit), and
# more requests than max_concurrency (admission while others decode)
_GEN = torch.Generator().manual_seed(5)
_SHARED = torch.randint(3, VOCAB, (16,), generator=_GEN).tolist()
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_GEN).tolist() for n in (5, 13, 21)] + [
    _SHARED + [7, 8, 9],
    _SHARED + [11, 12, 13, 14, 15],
]
MAX_TOKENS = [9, 12, 7, 10, 11]


def tiny_glm_with_mtp(directory) -> tuple:
    """A tiny GLM-4.7 (MoE, one MTP layer) written to ``directory`` and loaded, with its MTP drafter."""
    path = build_tiny_glm4_moe(directory, seed=21)
    model = load_model(path)
    ctx = LoadContext(path, read_hf_config(path), "glm", "Glm4MoeForCausalLM")
    return model, manager().hook.dgpp_build_draft(ctx=ctx, model=model)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return tiny_glm_with_mtp(tmp_path_factory.mktemp("spec_glm"))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """The dense Qwen3.5 hybrid with its MTP layer built on it (random weights: the hook's loading is tested
    in plugins/dgpp-qwen/tests/test_qwen3_5_mtp.py)."""
    model = load_model(build_tiny_checkpoint("qwen3_5", tmp_path_factory.mktemp("spec_qwen35"), seed=23))
    return model, random_qwen35_drafter(model, seed=24)


def random_qwen35_drafter(model, seed: int) -> nn.Module:
    from dgpp_qwen.qwen3_5_mtp import Qwen35MTPDrafter

    device = next(model.parameters()).device
    with torch.device(device):
        drafter = Qwen35MTPDrafter(model).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(drafter.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.dim() == 1 else 0.08 * noise)
    return drafter


class OracleDrafter(nn.Module):
    """A test double: proposes the token at ``p + 2`` of a known transcript (``wrong_from``: deeper drafts from
    that step on are off by one, so only a prefix is accepted; ``logit``: how sure it is)."""

    def __init__(
        self,
        scheduler: Scheduler,
        transcripts: dict[str, list[int]],
        wrong_from: int | None = None,
        logit: float = 1.0,
    ) -> None:
        super().__init__()
        self.scheduler, self.transcripts, self.wrong_from = scheduler, transcripts, wrong_from
        self.logit = logit  # the proposed token's logit (all others 0): the drafter's confidence in it

    def cache_spec(self) -> dict:
        return {}

    def forward(self, batch, previous_hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        by_slot = {s.slot: s for s in self.scheduler.live}
        out = torch.zeros(batch.num_tokens, VOCAB, device=batch.input_ids.device)
        starts = batch.query_start_loc.tolist()
        for i, slot in enumerate(batch.state_slots.tolist()):
            full = self.transcripts[by_slot[slot].request_id]
            for row in range(starts[i], starts[i + 1]):
                at = int(batch.positions[row]) + 2
                token = full[at] if at < len(full) else 0
                if self.wrong_from is not None and step >= self.wrong_from:
                    token = (token + 1) % VOCAB
                out[row, token] = self.logit
        return out[batch.logits_indices]

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return hidden


def serve(
    model,
    drafter=None,
    depth: int = 1,
    *,
    temperature: float = 0.0,
    oracle: dict | None = None,
    wrong_from: int | None = None,
    eos: frozenset[int] = frozenset(),
    kv_dtype: str = "auto",
    schedule: ScheduleSettings | None = None,
    oracle_logit: float = 1.0,
    penalties: dict | None = None,
    graphs: bool = False,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Every prompt through one scheduler (MTP on when a drafter or an oracle is given); tokens per request. K/V
    (the target's and the drafter's) stored as ``kv_dtype`` (``engine.kv_dtype``) says; ``graphs``: decode and
    verify steps through the decode graphs' static batch."""
    conf = scheduler_config(block_size=BS, chunk_tokens=CHUNK, max_concurrency=3)
    spec = stored_as(model.cache_spec(), kv_dtype)
    pools = CachePools(spec, BLOCKS, BS, conf.max_concurrency + 4, device=next(model.parameters()).device)
    runner = ModelRunner(model, pools)
    if graphs:  # the decode graphs: captured on CUDA, elsewhere their padded static batch runs eagerly
        runner.graphs = DecodeGraphs(model, pools, conf.max_concurrency, BLOCKS)
    blocks, slots = BlockPool(BLOCKS, BS), SlotPool(conf.max_concurrency, 4)
    cache = PrefixCache(blocks, CHUNK, hybrid=model.info.hybrid, slots=slots, copy_state=pools.copy_state)
    sched = Scheduler(conf, runner, blocks, slots, cache, eos_token_ids=eos)
    if oracle is not None:
        drafter = OracleDrafter(sched, oracle, wrong_from, oracle_logit)
    if drafter is not None:
        sched.speculative = SpeculativeDecoder(runner, drafter, depth, kv_dtype=kv_dtype, schedule=schedule)
    out: dict[str, list[int]] = {}

    def sink(s: Sequence, ev: SeqEvent) -> None:
        assert ev.error is None, ev.error
        out.setdefault(s.request_id, []).extend(ev.tokens)

    for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
        params = SamplingParams(
            temperature=temperature, max_tokens=n, seed=100 + i if temperature else None, **(penalties or {})
        )
        sched.submit([Sequence(f"r{i}", 0, prompt, params, ChoiceSampler(params, VOCAB, prompt), sink)])
    for _ in range(400):
        if not sched.has_work:
            break
        sched.tick()
    assert not sched.has_work, "scheduler did not drain"
    return out, sched


def _check_counters(sched: Scheduler, depth: int) -> dict:
    spec = engine_report(Published(sched))["scheduler"]["spec_decode"]
    assert spec["depth"] == depth
    assert spec["num_drafts_total"] > 0 and spec["num_draft_tokens_total"] >= spec["num_drafts_total"]
    assert spec["num_draft_tokens_total"] == sum(spec["num_draft_tokens_per_pos_total"])
    assert spec["num_accepted_tokens_total"] == sum(spec["num_accepted_tokens_per_pos_total"])
    assert len(spec["num_draft_tokens_per_pos_total"]) == depth
    # every verify feeds each request its last token plus its drafts: rows = requests + drafts; no graph replays
    batch = engine_report(Published(sched))["scheduler"]["decode_batch"]
    assert batch["rows"] == sched.stats.decode_rows + spec["num_draft_tokens_total"]
    assert batch["rows"] > sched.stats.decode_rows and batch["replays"] == 0
    assert 1.0 <= batch["last_rows_per_request"] <= depth + 1
    return spec


@pytest.mark.parametrize("depth", [1, 3])
def test_glm_greedy_mtp_equals_plain(glm, depth):
    model, drafter = glm
    plain, _ = serve(model)
    assert [len(plain[f"r{i}"]) for i in range(len(PROMPTS))] == MAX_TOKENS
    spec, sched = serve(model, drafter, depth)
    assert spec == plain
    _check_counters(sched, depth)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_mimo_v26_greedy_mtp_equals_plain(tmp_path, kv_dtype):
    """MiMo-V2.6 as shipped (fused FP8 qkv, MXFP4 experts): its MTP layer attends a sliding window over the
    drafter's paged pool while the target's sliding layers keep per-request rings, restored on rejection; with
    ``engine.kv_dtype: fp8`` every one of those caches holds e4m3 rows, and speculation on still equals off."""
    from dgpp.config import EngineConfig
    from dgpp_mimo.testing import build_tiny_mimo
    from dgpp_mimo.testing_v26 import write_v26_checkpoint

    v26, _ = write_v26_checkpoint(
        build_tiny_mimo(tmp_path / "flash", seed=31, vocab_size=VOCAB),
        tmp_path / "v26",
        tmp_path / "twin",
        mtp_layers=1,
        seed=32,
    )
    model = load_model(v26)
    drafter = manager().hook.dgpp_build_draft(ctx=load_context(v26, EngineConfig(mtp=True)), model=model)
    plain, _ = serve(model, kv_dtype=kv_dtype)
    for depth in (1, 2):
        spec, sched = serve(model, drafter, depth, kv_dtype=kv_dtype)
        assert spec == plain
        _check_counters(sched, depth)
        assert isinstance(sched.speculative, SpeculativeDecoder)
        draft_k = next(iter(sched.speculative.draft_pools.kv.values()))[0]
        assert (draft_k.element_size() == 1) == (kv_dtype == "fp8")
    if kv_dtype == "fp8":  # the lever is on: its tokens leave the exact chain's somewhere
        assert plain != serve(model)[0]


def test_eos_retires_mid_step(glm):
    """An EOS among the accepted tokens ends the request there: the oracle drafts past it, the tokens after it
    are dropped, as in plain decoding."""
    model, _ = glm
    full, _ = serve(model)
    eos = frozenset({full["r1"][3]})
    plain, _ = serve(model, eos=eos)
    assert len(plain["r1"]) == full["r1"].index(full["r1"][3]) + 1 < MAX_TOKENS[1]
    transcripts = {f"r{i}": PROMPTS[i] + full[f"r{i}"] for i in range(len(PROMPTS))}
    spec, _ = serve(model, depth=3, oracle=transcripts, eos=eos)
    assert spec == plain


def test_qwen35_hybrid_greedy_mtp_equals_plain(qwen35):
    model, drafter = qwen35
    plain, _ = serve(model)
    spec, sched = serve(model, drafter, 2)
    assert spec == plain
    _check_counters(sched, 2)


def test_qwen4_exp_greedy_mtp_equals_plain(tmp_path):
    """qwen4_exp's drafter (QSA layer with index keys in its own paged pools) through the hook."""
    from dgpp_qwen.testing_qwen4_exp import build_tiny_qwen4_exp

    path = build_tiny_qwen4_exp(tmp_path, seed=3, with_mtp=True)
    model = load_model(path)
    drafter = manager().hook.dgpp_build_draft(ctx=load_context(path), model=model)
    plain, _ = serve(model)
    spec, sched = serve(model, drafter, 2)
    assert spec == plain
    _check_counters(sched, 2)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp4"])
def test_glm_moe_dsa_greedy_mtp_equals_plain(tmp_path, kv_dtype):
    """Full GLM-5.3's drafter (an MLA block with its own DSA indexer over latent and index-key pools; index_topk 8
    below most prompts, so both the target's and the drafter's selections are sparse) through the hook; under
    ``engine.kv_dtype`` fp8 / fp4 the target's and the drafter's latents and index keys are quantized alike."""
    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    path = build_tiny_glm_moe_dsa(tmp_path, seed=7, mtp_layers=1)
    model = load_model(path)
    drafter = manager().hook.dgpp_build_draft(ctx=load_context(path), model=model)
    plain, _ = serve(model, kv_dtype=kv_dtype)
    spec, sched = serve(model, drafter, 2, kv_dtype=kv_dtype)
    assert spec == plain
    _check_counters(sched, 2)
    assert isinstance(sched.speculative, SpeculativeDecoder)
    assert bool(sched.speculative.draft_pools.kv_scales) == (kv_dtype != "auto")


@pytest.fixture(scope="module")
def glm5_next(tmp_path_factory):
    """GLM-5.3-Flash as the NVFP4-FP8 release ships it, with its MTP drafter (NoPE MLA with its own k-pooled
    indexer, pools of 4 with 2 selected, so most prompts run sparse; the open pool's rows in a per-request ring)."""
    from dgpp.config import EngineConfig
    from dgpp_glm.testing_glm5_next_release import write_release_checkpoint

    root = tmp_path_factory.mktemp("spec_glm5_next")
    packed, _ = write_release_checkpoint(root / "packed", root / "twin", seed=9)
    model = load_model(packed)
    return model, manager().hook.dgpp_build_draft(
        ctx=load_context(packed, EngineConfig(mtp=True)), model=model
    )


def test_glm5_next_greedy_mtp_equals_plain(glm5_next):
    """The target's KDA state is restored on rejection; the drafter's ring is saved around deeper drafts."""
    model, drafter = glm5_next
    plain, _ = serve(model)
    for depth in (1, 2, 3):
        spec, sched = serve(model, drafter, depth)
        assert spec == plain
        _check_counters(sched, depth)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp4"])
def test_glm5_next_greedy_mtp_equals_plain_with_quantized_latents(glm5_next, kv_dtype):
    """``engine.kv_dtype`` fp8 / fp4: the target's and the drafter's latents and pooled index keys quantized."""
    model, drafter = glm5_next
    plain, _ = serve(model, kv_dtype=kv_dtype)
    spec, sched = serve(model, drafter, 2, kv_dtype=kv_dtype)
    assert spec == plain
    _check_counters(sched, 2)


def test_deeper_drafts_leave_the_drafter_state_as_the_accepted_rows_left_it(glm5_next, monkeypatch):
    """The provisional rows of drafts 2 and 3 write the drafter's ring (positions past the accepted prefix); after
    each draft pass its state is what the backlog's accepted rows left."""
    model, drafter = glm5_next
    after_backlog: dict[int, list[torch.Tensor]] = {}
    checked: list[bool] = []
    draft_step, draft = SpeculativeDecoder._draft_step, SpeculativeDecoder._draft

    def step(self, items, previous, index, want_logits=True, input_ids=None):
        out = draft_step(self, items, previous, index, want_logits, input_ids)
        if index == 0 and want_logits:
            after_backlog.clear()
            after_backlog.update(self._save_draft_state([s for s, _, _ in items]))
        return out

    def drafted(self, seqs, depths, rule=None):
        out = draft(self, seqs, depths, rule)
        for slot, kept in after_backlog.items():
            checked.append(
                all(torch.equal(t[slot], k) for t, k in zip(self._draft_state_tensors(), kept, strict=True))
            )
        return out

    monkeypatch.setattr(SpeculativeDecoder, "_draft_step", step)
    monkeypatch.setattr(SpeculativeDecoder, "_draft", drafted)
    serve(model, drafter, 3)
    assert checked and all(checked)


def test_oracle_drafter_is_fully_accepted(glm):
    model, _ = glm
    plain, base = serve(model)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    spec, sched = serve(model, depth=3, oracle=transcripts)
    assert spec == plain
    counters = _check_counters(sched, 3)
    assert counters["num_accepted_tokens_total"] == counters["num_draft_tokens_total"]
    # up to four tokens per verify: far fewer decode steps than tokens
    assert sched.stats.decode_rows < base.stats.decode_rows / 2
    # plain decode feeds one row per request; full acceptance at depth 3 averages well over two
    assert base.stats.last_rows_per_request == 1.0 and base.stats.decode_batch_rows == base.stats.decode_rows
    assert sched.stats.decode_batch_rows > 2 * sched.stats.decode_rows


def test_penalties_count_the_drafts_ahead_of_a_verify_row(glm, monkeypatch):
    """A verify row's penalties see the drafts before it as emitted (they are, when the row counts): greedy with
    repetition and frequency penalties and an oracle's drafts equals plain, and would not if they were left out."""
    from dgpp.sample.sampler import TokenHistory

    model, _ = glm
    penalties = {"repetition_penalty": 1.5, "frequency_penalty": 2.0}
    plain, _ = serve(model, penalties=penalties)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    spec, sched = serve(model, depth=3, oracle=transcripts, penalties=penalties)
    assert spec == plain
    counters = _check_counters(sched, 3)
    assert counters["num_accepted_tokens_total"] == counters["num_draft_tokens_total"]
    monkeypatch.setattr(TokenHistory, "extended", lambda self, tokens, device: self)
    blind, _ = serve(model, depth=3, oracle=transcripts, penalties=penalties)
    assert blind != plain


def test_hybrid_partial_acceptance_restores_state(qwen35):
    """Drafts right at depth 1 and wrong at depth 2: every verify keeps 2 of 3 rows, so the GDN state is
    restored and the accepted rows are run again; the transcript stays the plain one."""
    model, _ = qwen35
    plain, _ = serve(model)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    spec, sched = serve(model, depth=2, oracle=transcripts, wrong_from=1)
    assert spec == plain
    counters = _check_counters(sched, 2)
    per_pos = counters["num_accepted_tokens_per_pos_total"]
    assert per_pos[0] == counters["num_draft_tokens_per_pos_total"][0] and per_pos[1] == 0


def test_glm5_next_partial_acceptance_restores_kda_state_and_index_rings(glm5_next):
    """GLM-5.3-Flash as the target with drafts right at depths 1 and 2 and wrong at 3: every verify keeps 3 of 4
    rows, so the KDA states and the indexers' open-pool rings are restored and the accepted rows run again."""
    model, _ = glm5_next
    plain, _ = serve(model)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    spec, sched = serve(model, depth=3, oracle=transcripts, wrong_from=2)
    assert spec == plain
    counters = _check_counters(sched, 3)
    per_pos = counters["num_accepted_tokens_per_pos_total"]
    assert per_pos[0] == counters["num_draft_tokens_per_pos_total"][0] > 0 and per_pos[2] == 0


def test_seeded_sampling_with_mtp_is_reproducible(glm):
    model, drafter = glm
    first, sched = serve(model, drafter, 2, temperature=0.9)
    second, _ = serve(model, drafter, 2, temperature=0.9)
    assert first == second
    assert [len(first[f"r{i}"]) for i in range(len(PROMPTS))] == MAX_TOKENS
    _check_counters(sched, 2)


def test_oracle_drafts_are_accepted_when_sampling(glm):
    """The ratio test keeps a greedy draft with the target's probability of it: at a near-greedy temperature the
    plain greedy transcript as drafts is accepted almost always."""
    model, _ = glm
    plain, _ = serve(model)
    transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
    _, sched = serve(model, depth=2, oracle=transcripts, temperature=0.01)
    counters = _check_counters(sched, 2)
    assert counters["num_accepted_tokens_total"] > 0.8 * counters["num_draft_tokens_total"]


def test_ratio_test_keeps_the_target_distribution():
    """Accept-with-p(draft), else draw from the residual: the emitted token is distributed as the target's p,
    and the draft is kept with probability p(draft); every seed's row judged in one batched call."""
    from dgpp.sample.batch import Row, sample_rows

    logits = torch.tensor([2.0, 1.5, 0.3, -1.0, 0.9, 0.0, -0.5, 1.1])
    target = torch.zeros(8, dtype=torch.float64)
    kept = torch.topk(logits, 6).indices
    target[kept] = torch.softmax(logits[kept].double() / 0.8, 0)
    draft, n = 1, 6000
    choices = [
        ChoiceSampler(SamplingParams(temperature=0.8, top_k=6, max_tokens=1, seed=seed), 8, [0])
        for seed in range(n)
    ]
    drawn = sample_rows(logits.expand(n, 8), [Row(c, drafted=True) for c in choices], torch.full((n,), draft))
    counts = torch.bincount(torch.tensor(drawn.tokens), minlength=8).double()
    assert all(took == (token == draft) for token, took in zip(drawn.tokens, drawn.accepted, strict=True))
    assert counts[3] == 0 and counts[6] == 0  # filtered ids never come out
    assert float((counts / n - target).abs().max()) < 0.02
    assert abs(sum(drawn.accepted) / n - float(target[draft])) < 0.02


def test_engine_mtp_builds_the_decoder_through_the_hook(tmp_path):
    """``engine.mtp`` off: no decoder (the default decode path); on: the family's drafter at ``engine.mtp_depth``;
    on for a checkpoint without MTP layers: a ConfigError naming the key."""
    from dgpp.config import EngineConfig
    from dgpp.errors import ConfigError
    from dgpp.startup.speculative_build import build_speculative
    from dgpp_glm.draft import Glm4MoeMTPDrafter

    def runner_for(path):
        model = load_model(path)
        return ModelRunner(model, CachePools(model.cache_spec(), 8, BS, 2))

    path = build_tiny_glm4_moe(tmp_path / "mtp", seed=31)
    runner = runner_for(path)
    assert build_speculative(EngineConfig(), load_context(path), runner, pm=manager()) is None
    on = EngineConfig(mtp=True, mtp_depth=3)
    decoder = build_speculative(on, load_context(path, on), runner, pm=manager())
    assert isinstance(decoder.drafter, Glm4MoeMTPDrafter) and decoder.depth == 3 and decoder.stats.depth == 3
    assert set(decoder.draft_pools.kv) == {"mtp.0.self_attn"} and decoder.draft_pools.num_blocks == 8
    deep = EngineConfig(mtp=True, mtp_depth=6)  # past what a chained MTP layer verifies
    with pytest.raises(ConfigError, match="engine.mtp_depth: 6 exceeds 5, the most drafts Glm4MoeMTPDrafter"):
        build_speculative(deep, load_context(path, deep), runner, pm=manager())
    bare = build_tiny_glm4_moe(tmp_path / "bare", seed=32, num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match=r"engine\.mtp"):
        build_speculative(
            EngineConfig(mtp=True), load_context(bare, EngineConfig(mtp=True)), runner_for(bare), pm=manager()
        )
