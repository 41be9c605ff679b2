"""The DeepSeek-V4.1 float64 reference, its packed-format decoders and the tiny release-layout fixture.

- The element decoders equal torch's own E4M3 / E8M0 reinterpretations and the OCP E2M1 grid; every packed
  fixture tensor round-trips (decode then encode gives the stored bytes back) and the encoders give exactly the
  quantized values an independent rounding gives.
- The fixture holds the release's names, dtypes and every layer role.
- The reference is causal (a prefix's logits are the longer prompt's first rows), its chunked and one-row-at-a-
  time forms equal the one-shot prefill, and every part of the model moves the logits on the fixture: the
  window / compressed / index rounding, the candidate restriction (and its two readings), the group-shared KV
  and selection, Engram and the single-pass collapse.
- The bounded prefill walks the decoder over the last window only; the traced decision margins locate the rows
  where rounding noise can flip the logits, which ``assert_matches_reference`` tells from disagreements.
- The release's own numbers: its geometry parses with its layer roles, its Engram table sizes are the prime
  buckets' sums, and DeepSeek-V4's vocabulary normalises to its 99,092 Engram classes.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from deepseek_v41_fixture import TINY_TEXT, build_tiny_deepseek_v41
from deepseek_v41_formats import (
    E2M1_TABLE,
    E4M3_TABLE,
    E8M0_TABLE,
    decode_e8m0,
    decode_engram_rows,
    decode_fp8_block,
    decode_mxfp4,
    encode_e2m1,
    encode_e4m3,
    encode_engram_rows,
    encode_fp8_block,
    encode_mxfp4,
    read_safetensors,
    unpack_e2m1_pairs,
)
from deepseek_v41_reference import (
    DeepseekV41Reference,
    ReferenceOptions,
    assert_matches_reference,
    load_reference,
)
from deepseek_v41_reference_config import load_config
from deepseek_v41_reference_csa2 import candidate_pool
from deepseek_v41_reference_engram import EngramHasher, compressed_token_map

F64 = torch.float64
PROMPT = "The quick brown fox jumps over the lazy dog. Hello world! What is the weather in Paris today?"


ORIGINALS: dict[str, torch.Tensor] = {}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    ORIGINALS.clear()
    return build_tiny_deepseek_v41(tmp_path_factory.mktemp("dsv41") / "ckpt", seed=3, originals=ORIGINALS)


@pytest.fixture(scope="module")
def prompt_ids(ckpt) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(PROMPT).ids
    assert len(ids) >= 20  # past the window (6), several candidate blocks and more entries than index_topk
    return ids


@pytest.fixture(scope="module")
def reference(ckpt):
    return load_reference(ckpt)


@pytest.fixture(scope="module")
def base_logits(reference, prompt_ids) -> torch.Tensor:
    return reference.forward(prompt_ids)


# ---- the formats ------------------------------------------------------------------------------------------------


def test_element_decoders_equal_the_format_definitions() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    torch_e4m3 = codes.view(torch.float8_e4m3fn).to(F64)
    assert torch.equal(E4M3_TABLE.isnan(), torch_e4m3.isnan())
    assert torch.equal(E4M3_TABLE.nan_to_num(), torch_e4m3.nan_to_num())
    assert E4M3_TABLE[0x7E] == 448 and E4M3_TABLE[1] == 2.0**-9  # the largest finite, the smallest subnormal
    torch_e8m0 = codes.view(torch.float8_e8m0fnu).to(F64)
    assert torch.equal(E8M0_TABLE.nan_to_num(), torch_e8m0.nan_to_num()) and E8M0_TABLE[255].isnan()
    ocp_e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert E2M1_TABLE.tolist() == ocp_e2m1 + [-v for v in ocp_e2m1]


def _pow2_above(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= fmax (no frexp: a log2 guess corrected by the definition)."""
    e = torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / fmax))
    e = torch.where(amax <= fmax * torch.exp2(e - 1), e - 1, e)
    e = torch.where(amax > fmax * torch.exp2(e), e + 1, e)
    return torch.exp2(e.clamp(-127, 127))


def _nearest_on(grid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The nearest of ``grid`` (ascending non-negative values, even index = even code) to ``x`` in magnitude,
    ties to the even code, by brute force in float64 (torch's float64 -> float8 cast rounds through float32
    first, so a value just under a tie can round up there)."""
    dist = (x.abs().unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    odd = (torch.arange(grid.numel()) % 2) * 1e-300
    return grid[torch.where(dist == best, odd, torch.full_like(dist, 1.0)).argmin(-1)] * x.sign()


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    return _nearest_on(torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=F64), x)


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    grid = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)  # torch's own E4M3 values
    return _nearest_on(grid, x.clamp(-448, 448))


def test_encoders_give_the_independently_rounded_values_and_decode_bit_exactly() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 160, generator=gen, dtype=F64) * torch.logspace(-6, 2, 160, dtype=F64)
    for n, k in ((96, 160), (88, 150)):  # whole 32 x 32 blocks, then partial edge blocks (a ceil grid)
        part = w[:n, :k]
        codes, scale = encode_fp8_block(part)
        assert scale.shape == (-(-n // 32), -(-k // 32))
        padded = torch.nn.functional.pad(part.abs(), (0, -k % 32, 0, -n % 32))
        blocks = padded.unflatten(0, (-1, 32)).unflatten(-1, (-1, 32)).amax(dim=(1, 3))
        s = _pow2_above(blocks, 448.0).repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
        expected = _nearest_e4m3(part / s) * s
        assert torch.equal(decode_fp8_block(codes, scale), expected)

    packed, scale = encode_mxfp4(w)
    s = _pow2_above(w.abs().unflatten(-1, (-1, 32)).amax(-1), 6.0).repeat_interleave(32, 1)
    expected = _nearest_e2m1(w / s) * s
    assert packed.dtype == torch.int8 and packed.shape == (96, 80) and scale.shape == (96, 5)
    assert torch.equal(decode_mxfp4(packed, scale), expected)

    codes, scale = encode_engram_rows(w)
    s = _pow2_above(w.abs().unflatten(-1, (-1, 32)).amax(-1), 448.0).repeat_interleave(32, 1)
    assert torch.equal(decode_engram_rows(codes, scale), _nearest_e4m3(w / s) * s)


def test_fixture_tensors_are_the_release_layout_and_round_trip(ckpt) -> None:
    stored = read_safetensors(ckpt / "model.safetensors")
    assert not any(n.startswith("model.") for n in stored)
    assert {"embed.weight", "norm.weight", "head.weight"} <= set(stored)
    dtypes = {n: t.dtype for n, t in stored.items()}
    assert dtypes["embed.weight"] == dtypes["head.weight"] == "BF16"
    assert (
        dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    )
    assert dtypes["layers.0.attn.wo_a.weight"] == "F8_E4M3"
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == "I8" and stored[
        "layers.0.ffn.experts.0.w1.scale"
    ].shape == (64, 2)
    assert dtypes["layers.0.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert dtypes["layers.1.engram.embed.weight"] == "F8_E4M3" and stored[
        "layers.1.engram.embed.scale"
    ].shape == (304, 1)
    assert (
        dtypes["layers.0.attn.attn_sink"]
        == dtypes["layers.0.hc_attn_fn"]
        == dtypes["layers.0.ffn.gate.bias"]
        == "F32"
    )
    # every packed tensor decodes to its drawn values rounded independently (the nearest of torch's E4M3
    # values, the nearest E2M1) under power-of-two scales found by search, and its codes come back from its decoded values
    packed = 0
    for name, t in stored.items():
        if not name.endswith(".weight") or name[:-7] + ".scale" not in stored:
            continue
        scale, drawn = stored[name[:-7] + ".scale"].codes(), ORIGINALS[name]
        groups = drawn.abs().unflatten(-1, (-1, 32)).amax(-1)
        fmax = 6.0 if t.dtype == "I8" else 448.0
        per_block = (
            groups if t.dtype == "I8" or ".engram.embed." in name else groups.unflatten(0, (-1, 32)).amax(1)
        )
        assert torch.equal(decode_e8m0(scale), _pow2_above(per_block, fmax)), name
        if t.dtype == "I8":
            s = _pow2_above(groups, 6.0).repeat_interleave(32, 1)
            assert torch.equal(decode_mxfp4(t.codes(), scale), _nearest_e2m1(drawn / s) * s), name
            values = decode_mxfp4(t.codes(), scale) / s
            assert torch.equal(encode_e2m1(values).long(), unpack_e2m1_pairs(t.codes())), name
        else:
            if ".engram.embed." in name:
                s = _pow2_above(groups, 448.0).repeat_interleave(32, 1)
                decoded = decode_engram_rows(t.codes(), scale)
            else:
                blocks = groups.unflatten(0, (-1, 32)).amax(1)
                s = _pow2_above(blocks, 448.0).repeat_interleave(32, 0).repeat_interleave(32, 1)
                decoded = decode_fp8_block(t.codes(), scale)
            assert torch.equal(decoded, _nearest_e4m3(drawn / s) * s), name
            assert torch.equal(encode_e4m3(decoded / s), t.codes()), name
        packed += 1
    assert packed > 300


def test_fixture_config_has_every_layer_role(ckpt) -> None:
    root = json.loads((ckpt / "config.json").read_text())
    assert root["model_type"] == "deepseek_v41" and root["quantization_config"]["weight_block_size"] == [
        32,
        32,
    ]
    cfg = load_config(ckpt)
    ratios = set(cfg.compress_ratios)
    assert ratios == {0, 1, 2}
    reuse = [n for n in range(cfg.num_hidden_layers) if cfg.ratio(n) and cfg.kv_source_of(n) != n]
    reindex = [n for n in cfg.index_source_layer_ids if n not in cfg.kv_source_layer_ids]
    assert reuse and reindex and all(cfg.uses_candidates(n) for n in reindex)
    assert cfg.candidate_source_layer_id in cfg.kv_source_layer_ids and cfg.engram_layer_ids
    assert cfg.index_n_heads >= 16 and cfg.sliding_window == 6


# ---- the Engram hashing ---------------------------------------------------------------------------------------


def test_engram_token_map_and_buckets(ckpt) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    token_map, classes = compressed_token_map(ckpt / "tokenizer.json")
    cfg = load_config(ckpt)
    assert classes == cfg.engram_compressed_vocab_size < cfg.vocab_size
    vocab = tok.get_vocab()
    assert token_map[vocab["The"]] == token_map[vocab["the"]] != token_map[vocab["Paris"]]
    hasher = EngramHasher.build(cfg, token_map)
    assert hasher.primes[0] == ((41, 43), (47, 53), (59, 61)) and hasher.primes[1][0] == (67, 71)
    ids = tok.encode(PROMPT).ids
    rows = hasher.rows(ids, range(len(ids)), 0)
    bounds = [0, 41, 84, 131, 184, 243, 304]
    for row in rows:
        assert all(bounds[c] <= r < bounds[c + 1] for c, r in enumerate(row))
    # a position's rows depend on its last four tokens only: the 2-gram rows on the last two, and so on
    p = 9
    assert hasher.rows([7, 7, 7] + ids[p - 3 :], range(6, 7), 0) == [rows[p]]
    changed = list(ids)
    changed[p - 3] = (changed[p - 3] + 1) % 512
    moved = hasher.rows(changed, range(p, p + 1), 0)[0]
    assert moved[:4] == rows[p][:4] and moved[4:] != rows[p][4:]


# ---- the reference --------------------------------------------------------------------------------------------


def test_reference_runs_and_is_causal(reference, prompt_ids, base_logits) -> None:
    assert base_logits.shape == (len(prompt_ids), 512) and base_logits.dtype == F64
    assert torch.isfinite(base_logits).all() and base_logits.std() > 0.1
    prefix = reference.forward(prompt_ids[:13])
    assert (prefix - base_logits[:13]).abs().max() < 1e-12


def test_decode_and_chunked_forms_equal_the_one_shot_prefill(reference, prompt_ids, base_logits) -> None:
    session = reference.new_session()
    rows = [session.extend(prompt_ids[:7])]  # a chunk ending inside a ratio-2 group (7 rows)
    rows += [session.extend([t]) for t in prompt_ids[7:12]]  # decode rows
    rows.append(session.extend(prompt_ids[12:]))
    assert (torch.cat(rows) - base_logits).abs().max() < 1e-12


def test_candidate_pool_readings() -> None:
    cfg = load_config_like(candidate_block_size=2, candidate_topk_blocks=2)
    scores = torch.tensor([[5.0, 1.0, 0.0, 9.0, 2.0, -math.inf, -math.inf]], dtype=F64)
    visible = torch.tensor([5])
    release = candidate_pool(cfg, scores, visible, "release")
    engine = candidate_pool(cfg, scores, visible, "engine")
    # release: the newest block (entry 4, partial) pinned + the best other block (2, 3)
    assert release.tolist() == [[False, False, True, True, True, False, False]]
    # engine: the two best complete blocks (2, 3) and (0, 1), plus the partial block's entry 4
    assert engine.tolist() == [[True, True, True, True, True, False, False]]


def load_config_like(**over):
    from deepseek_v41_fixture import tiny_deepseek_v41_config
    from deepseek_v41_reference_config import parse_config

    root = tiny_deepseek_v41_config(**over)
    root["text_config"]["engram_layer_ids"] = []
    return parse_config(root)


ABLATIONS = [
    ("window_fp8", False),
    ("compressed_fp4", False),
    ("index_fp4", False),
    ("candidate_pool", "engine"),
    ("restrict_to_candidates", False),
    ("reuse_compressed_kv", False),
    ("reuse_selection", False),
    ("engram", False),
    ("single_pass_hc", False),
]


@pytest.mark.parametrize(("switch", "value"), ABLATIONS, ids=[a for a, _ in ABLATIONS])
def test_every_part_moves_the_logits(reference, prompt_ids, base_logits, switch, value) -> None:
    model = DeepseekV41Reference(
        reference.cfg,
        reference.w,
        reference.hasher,
        dataclasses.replace(ReferenceOptions(), **{switch: value}),
    )
    diff = (model.forward(prompt_ids) - base_logits).abs().max(-1).values
    assert diff.max() > 0.05, f"{switch}={value} leaves the logits at most {diff.max():.2e} away"


def test_trace_shows_the_group_sharing_and_the_candidate_restriction(reference, prompt_ids) -> None:
    session = reference.new_session(trace=True)
    session.extend(prompt_ids)
    trace, cfg = session.trace, reference.cfg
    for layer in range(cfg.num_hidden_layers):
        if (
            cfg.ratio(layer) and layer not in cfg.index_source_layer_ids
        ):  # a reuse layer: its indexer's selection
            assert torch.equal(trace[layer]["selection"], trace[cfg.index_source_of(layer)]["selection"])
    for layer in cfg.index_source_layer_ids:
        counts = trace[layer]["selection"].sum(-1)
        visible = (torch.arange(len(prompt_ids)) + 1) // cfg.ratio(layer)
        assert torch.equal(counts, visible.clamp(max=cfg.index_topk))
    reindex = 8
    selection, pool = trace[reindex]["selection"], trace[reindex]["candidates"]
    assert not (selection & ~pool).any()
    visible = torch.arange(len(prompt_ids)) + 1
    assert (pool.sum(-1) < visible).any()  # the pool excludes entries a row can see
    assert not torch.equal(trace[cfg.candidate_source_layer_id]["selection"], selection)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match="kv_source_layer_ids"):
        load_config_like(kv_source_layer_ids=[2, 4])  # layers 6..9 (ratio 1) would read a ratio-2 group
    with pytest.raises(ValueError, match="candidate_source_layer_id"):
        load_config_like(candidate_source_layer_id=7)  # not an index source


def test_bounded_prefill_walks_the_decoder_over_the_last_window(reference, prompt_ids, base_logits) -> None:
    window, n = reference.cfg.sliding_window, len(prompt_ids)
    short = reference.new_session().extend(prompt_ids[:window], bounded=True)
    assert (short - base_logits[:window]).abs().max() < 1e-12  # one window: the segment is every row
    session = reference.new_session(trace=True)
    bounded = session.extend(prompt_ids, bounded=True)
    assert bounded[: n - window].isnan().all() and torch.isfinite(bounded[n - window :]).all()
    rows = [len(record["streams"]) for record in session.trace]
    decoder = max(reference.cfg.kv_source_layer_ids)
    assert rows == [n] * decoder + [window] * (reference.cfg.num_hidden_layers - decoder)
    # lossy: the decoder's first segment rows lose their window; the last row's logits move
    assert (bounded[-1] - base_logits[-1]).abs().max() > 1e-3
    # the encoder and the published entries are the exact walk's: a decode row after it runs on the same pool
    exact_session = reference.new_session()
    exact_session.extend(prompt_ids)
    assert torch.equal(session.groups[decoder].entries, exact_session.groups[decoder].entries)
    assert torch.isfinite(session.extend([prompt_ids[0]])).all()


def test_the_reference_imports_nothing_from_dgpp() -> None:
    import ast
    from pathlib import Path

    here = Path(__file__).parent
    modules = ["deepseek_v41_formats"] + [
        f"deepseek_v41_reference{p}" for p in ("", "_config", "_csa2", "_engram")
    ]
    for module in modules:
        for node in ast.walk(ast.parse((here / f"{module}.py").read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n == "dgpp" or n.startswith(("dgpp.", "dgpp_")) for n in names), (module, names)


def test_the_release_geometry_parses_and_its_engram_tables_match_the_buckets() -> None:
    from deepseek_v41_reference_config import parse_config
    from deepseek_v41_reference_engram import bucket_primes

    text = {
        **TINY_TEXT,
        "vocab_size": 129280,
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1280,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048,
        "candidate_block_size": 8,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 512,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "engram_vocab_size": 16000000,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_compressed_vocab_size": 99092,
    }
    cfg = parse_config({"model_type": "deepseek_v41", "text_config": text})
    assert [cfg.kv_source_of(n) for n in (1, 2, 7, 8, 19, 20, 39)] == [-1, 2, 2, 8, 14, 20, 20]
    assert [cfg.index_source_of(n) for n in (3, 21, 24, 27, 39)] == [2, 20, 24, 24, 36]
    assert cfg.uses_candidates(24) and not cfg.uses_candidates(20) and not cfg.uses_candidates(25)
    # the release's table sizes are the sums of its prime buckets: 24 primes above 15,999,999 per layer
    primes = bucket_primes(2, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
    assert [sum(sum(h) for h in layer) for layer in primes] == list(cfg.engram_num_embeddings)
    assert primes[0][0][0] == 16000057


@pytest.mark.slow
def test_the_deepseek_v4_vocabulary_normalises_to_the_release_class_count() -> None:
    """V4.1 keeps DeepSeek-V4's 129,280-token vocabulary; its normalised classes are the release's
    engram_compressed_vocab_size, 99,092 (the pad token 2 is its own class)."""
    from dgpp.testing.tokenizers import RegistryUnavailable, deepseek_v4_tokenizer_dir

    try:
        tokenizer_dir = deepseek_v4_tokenizer_dir()
    except RegistryUnavailable as e:
        pytest.skip(str(e))
    token_map, classes = compressed_token_map(tokenizer_dir / "tokenizer.json")
    assert (len(token_map), classes) == (129280, 99092)
    assert token_map[2] == 2


def test_decision_margins_locate_the_rows_where_rounding_noise_flips_the_logits(reference) -> None:
    """The traced margins find where an fp32 model may part from the reference: under input noise near fp32's
    (a relative 3e-7 on the embedding) the logits jump first at a row whose closest decision lies within 3e-6
    of its boundary, and such rows are few."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 512, (40,), generator=gen).tolist()
    session = reference.new_session(trace=True)
    base = session.extend(prompt)
    margin = torch.stack([record["margin"] for record in session.trace]).min(0).values
    assert (margin > 0).all() and (margin < 3e-6).sum() <= 8
    table = reference.w["embed.weight"]
    jumps = []
    try:
        for _ in range(6):
            reference.w["embed.weight"] = table * (
                1 + 3e-7 * torch.randn(table.shape, generator=gen, dtype=F64)
            )
            moved = (reference.forward(prompt) - base).abs().max(-1).values
            if (moved > 1e-4).any():
                jumps.append(int((moved > 1e-4).nonzero()[0]))
    finally:
        reference.w["embed.weight"] = table
    assert jumps, "no near-tie flipped: the check is vacuous for this prompt"
    assert all(margin[row] < 3e-6 for row in jumps), [(row, float(margin[row])) for row in jumps]


def test_the_comparison_accepts_noise_flips_and_rejects_disagreements(reference) -> None:
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, 512, (40,), generator=gen).tolist()
    base = reference.forward(prompt)
    assert assert_matches_reference(reference, prompt, base + 1e-6) < 2e-6
    flipped = base.clone()
    flipped[8:] += 0.05  # row 8 holds a decision within 1e-7 of its boundary (the margins test's prompt)
    assert assert_matches_reference(reference, prompt, flipped) < 1e-12
    model = DeepseekV41Reference(
        reference.cfg, reference.w, reference.hasher, dataclasses.replace(ReferenceOptions(), engram=False)
    )
    with pytest.raises(AssertionError, match="a disagreement"):
        assert_matches_reference(reference, prompt, model.forward(prompt))
