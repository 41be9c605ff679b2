"""The DeepSeek-V4.1 float64 reference, its packed-format decoders and the tiny release-layout fixture.

- The element decoders equal torch's own E4M3 / E8M0 reinterpretations and the OCP E2M1 grid; every packed
  fixture tensor round-trips (decode then encode gives the stored bytes back) and the encoders give exactly the
  quantized values an independent rounding gives.
- The fixture holds the release's names, dtypes and every layer role.
- The reference is causal (a prefix's logits are the longer prompt's first rows), its chunked and one-row-at-a-
  time forms equal the one-shot prefill, and every part of the model moves the logits on the fixture: the
  window / compressed / index rounding, the candidate restriction (and its two readings), the group-shared KV
  and selection, Engram and the single-pass collapse.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from deepseek_v41_fixture import build_tiny_deepseek_v41
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
from deepseek_v41_reference import DeepseekV41Reference, ReferenceOptions, load_reference
from deepseek_v41_reference_config import load_config
from deepseek_v41_reference_csa2 import candidate_pool
from deepseek_v41_reference_engram import EngramHasher, compressed_token_map

F64 = torch.float64
PROMPT = "The quick brown fox jumps over the lazy dog. Hello world! What is the weather in Paris today?"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_deepseek_v41(tmp_path_factory.mktemp("dsv41") / "ckpt", seed=3)


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
    """2^ceil(log2(amax / fmax)) by search (no frexp): the smallest power of two s with amax / s <= fmax."""
    e = torch.full_like(amax, -127.0)
    for k in range(-127, 128):
        e = torch.where((e == -127) & (amax <= fmax * 2.0**k), torch.full_like(e, float(k)), e)
    return torch.exp2(e)


def _nearest_e2m1(x: torch.Tensor) -> torch.Tensor:
    grid = E2M1_TABLE[:8]
    dist = (x.abs().unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    even = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]) * 1e-12  # ties to the even code
    return grid[(dist + (dist == best) * even).argmin(-1)] * x.sign()


def test_encoders_give_the_independently_rounded_values_and_decode_bit_exactly() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 160, generator=gen, dtype=F64) * torch.logspace(-6, 2, 160, dtype=F64)
    codes, scale = encode_fp8_block(w)
    blocks = w.abs().unflatten(0, (-1, 32)).unflatten(-1, (-1, 32)).amax(dim=(1, 3))
    s = _pow2_above(blocks, 448.0).repeat_interleave(32, 0).repeat_interleave(32, 1)
    expected = (w / s).to(torch.float8_e4m3fn).to(F64) * s
    assert torch.equal(decode_fp8_block(codes, scale), expected)

    packed, scale = encode_mxfp4(w)
    s = _pow2_above(w.abs().unflatten(-1, (-1, 32)).amax(-1), 6.0).repeat_interleave(32, 1)
    expected = _nearest_e2m1(w / s) * s
    assert packed.dtype == torch.int8 and packed.shape == (96, 80) and scale.shape == (96, 5)
    assert torch.equal(decode_mxfp4(packed, scale), expected)

    codes, scale = encode_engram_rows(w)
    s = _pow2_above(w.abs().unflatten(-1, (-1, 32)).amax(-1), 448.0).repeat_interleave(32, 1)
    assert torch.equal(decode_engram_rows(codes, scale), (w / s).to(torch.float8_e4m3fn).to(F64) * s)


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
    # every packed tensor decodes to values whose codes under the stored scales are the stored codes
    packed = 0
    for name, t in stored.items():
        if not name.endswith(".weight") or name[:-7] + ".scale" not in stored:
            continue
        scale = stored[name[:-7] + ".scale"].codes()
        if t.dtype == "I8":
            values = decode_mxfp4(t.codes(), scale) / decode_e8m0(scale).repeat_interleave(32, 1)
            assert torch.equal(encode_e2m1(values).long(), unpack_e2m1_pairs(t.codes())), name
        else:
            if ".engram.embed." in name:
                s = decode_e8m0(scale).repeat_interleave(32, 1)
                values = decode_engram_rows(t.codes(), scale) / s
            else:
                s = decode_e8m0(scale).repeat_interleave(32, 0).repeat_interleave(32, 1)
                values = decode_fp8_block(t.codes(), scale) / s
            assert torch.equal(encode_e4m3(values), t.codes()), name
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
