"""DeepSeek-V4.1-Flash (deepseek_v41) against the float64 reference on the tiny release-layout fixture
(``deepseek_v41_fixture``: FP8 E4M3 + E8M0 32 x 32 blocks, MXFP4 experts, Engram tables as E4M3 rows): every
CSA2 role (window-only layers, two ratio-2 groups, a ratio-1 group with a candidate source and a restricted
reindex layer), a window of 6, ``index_topk`` 4, candidate blocks of 2 entries of which 3 are kept, Engram on
layers 1 and 4. Prompts run far past the window, the top-k and the candidate pool; chunk cuts fall inside the
ratio-2 pairs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from deepseek_v41_fixture import build_tiny_deepseek_v41
from deepseek_v41_reference import ReferenceOptions, assert_matches_reference, load_reference, load_weights
from deepseek_v41_reference_engram import compressed_token_map

from dgpp.errors import ConfigError
from dgpp.nn.linear import Linear
from dgpp.offline import greedy_generate
from dgpp.plugin_api import CompressedKV, EngineConfig, StateSpec, WindowBuffer, WindowKV
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.suite import HybridConformance
from dgpp_deepseek.v41_loader import checkpoint_name
from dgpp_deepseek.v41_model import DeepseekV41ForCausalLM


class ReferenceLM(torch.nn.Module):
    """The float64 reference behind the calls the conformance checks make (``model(ids).logits``, greedy
    ``generate``), its decode rows one token at a time."""

    def __init__(self, checkpoint: Path, options: ReferenceOptions | None = None) -> None:
        super().__init__()
        self.ref = load_reference(checkpoint, options)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.ref.forward(input_ids[0].tolist())[None].float())

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False) -> torch.Tensor:
        assert not do_sample
        session = self.ref.new_session()
        tokens = input_ids[0].tolist()
        logits = session.extend(tokens)[-1]
        for _ in range(max_new_tokens):
            tokens.append(int(torch.argmax(logits)))
            logits = session.extend(tokens[-1:])[-1]
        return torch.tensor([tokens])


def build_fp32_fixture(out: Path, seed: int = 0, **text_overrides) -> Path:
    """The fixture in fp32, its vocabulary the tokenizer's ids (the Engram classes cover exactly those)."""
    path = build_tiny_deepseek_v41(out, seed=seed, **text_overrides)
    ids = len(compressed_token_map(path / "tokenizer.json")[0])
    if ids != json.loads((path / "config.json").read_text())["text_config"]["vocab_size"]:
        path = build_tiny_deepseek_v41(out, seed=seed, vocab_size=ids, **text_overrides)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_fp32_fixture(tmp_path_factory.mktemp("deepseek_v41"))


@pytest.fixture(scope="module")
def fp32_pair(checkpoint):
    return load_model(checkpoint), ReferenceLM(checkpoint)


def test_every_role_gets_its_caches(fp32_pair):
    model, _ = fp32_pair
    assert isinstance(model, DeepseekV41ForCausalLM) and model.info.hybrid
    spec = model.cache_spec()
    assert all(isinstance(spec[f"layers.{i}.attn"], WindowKV) for i in range(10))
    for source, ratio in ((2, 2), (4, 2), (6, 1)):  # one compressed cache per group, at its kv source
        main, keys = spec[f"layers.{source}.attn.compressor"], spec[f"layers.{source}.attn.indexer"]
        # packed bytes: 64 channels as 32 nibble pairs + 4 E4M3 scales, 32 as 16 + 1 E8M0
        assert isinstance(main, CompressedKV) and (main.ratio, main.head_dim, main.dtype) == (
            ratio,
            36,
            torch.uint8,
        )
        assert isinstance(keys, CompressedKV) and (keys.ratio, keys.head_dim, keys.dtype) == (
            ratio,
            17,
            torch.uint8,
        )
    assert isinstance(spec["layers.2.attn.compressor.buffer"], WindowBuffer)
    assert "layers.6.attn.compressor.buffer" not in spec  # ratio 1 pools nothing
    assert not any(f"layers.{i}.attn.compressor" in spec for i in (0, 1, 3, 5, 7, 8, 9))
    assert isinstance(spec["layers.1.engram.context"], StateSpec)


def test_packed_weights_decode_bit_exactly_as_the_reference_decoders(checkpoint, fp32_pair):
    """Every FP8-block and dense projection as dgpp loads it equals the reference's decode of the same bits."""
    model, _ = fp32_pair
    reference = load_weights(checkpoint)
    checked = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            decoded = reference[checkpoint_name(name + ".weight")]
            dense = module(torch.eye(decoded.shape[1])).T  # an identity row picks a column exactly
            assert torch.equal(dense.double(), decoded), name
            checked += 1
    assert checked > 90
    experts = 0
    for layer_idx, layer in enumerate(model.layers):
        for proj, release in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            for e in range(layer.ffn.experts.num_experts):  # MXFP4: E2M1 pairs and E8M0 scales per 32
                decoded = reference[f"layers.{layer_idx}.ffn.experts.{e}.{release}.weight"]
                dense = layer.ffn.experts.expert_weight(proj, e, torch.float32)
                assert torch.equal(dense.double(), decoded), (layer_idx, proj, e)
                experts += 1
    assert experts == 10 * 3 * 8


def test_engram_rows_decode_bit_exactly(checkpoint, fp32_pair):
    model, _ = fp32_pair
    reference = load_weights(checkpoint)
    for layer in (1, 4):
        table = model.layers[layer].engram.table
        rows = reference[f"layers.{layer}.engram.embed.weight"]
        ids = torch.arange(rows.shape[0])
        assert torch.equal(table.rows(ids, torch.float32).double(), rows)


class TestDeepseekV41Conformance(HybridConformance):
    """Prompts far past the window (6), the top-k (4) and the candidate pool (6 entries); chunk sizes 1, 3 and 7
    cut inside the ratio-2 pairs; the snapshot splits inside a pair.

    The stored formats round: a value within ~1e-6 of an FP8 / FP4 rounding midpoint can take the other code in
    fp32 than in float64, and the rows that read it then differ by ~1e-3. The third prompt of the default seed
    has one (a window latent channel of its row 4), so the logits are checked on seed 1's prompts here, and the
    default seed's by ``test_rows_past_a_rounding_boundary_are_the_only_disagreements``."""

    logits_lengths = (5, 23, 40, 9)
    logits_seed = 1

    def test_logits_match_transformers(self, fp32_pair):
        """(the float64 reference here) within 1e-4 of every row, up to a row that holds a decision within 3e-6 of
        its boundary: where those fall depends on the CPU's fp32 products (an AVX-512 EPYC and an AMX Xeon put
        different rows of these prompts past one), so a row past such a decision is not compared."""
        model, ref = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.logits_lengths, seed=self.logits_seed)
        for prompt, logits in zip(prompts, conf.engine_all_logits(model, prompts), strict=True):
            assert assert_matches_reference(ref.ref, prompt, logits) < 1e-4

    def test_32_greedy_tokens_match_transformers_generate(self, fp32_pair):
        """32 greedy tokens, then the prompt and those tokens teacher-forced through the float64 reference: every
        row within 1e-4 up to a row past a rounding decision (as above), so the greedy tokens are the reference's
        up to there; no early end of sequence."""
        model, ref = fp32_pair
        prompts = conf.make_prompts(model.info.vocab_size, self.greedy_lengths, seed=self.greedy_seed)
        generated = greedy_generate(model, prompts, 32)
        assert [len(t) for t in generated] == [32] * len(prompts)
        sequences = [p + g[:-1] for p, g in zip(prompts, generated, strict=True)]
        for sequence, logits in zip(sequences, conf.engine_all_logits(model, sequences), strict=True):
            assert assert_matches_reference(ref.ref, sequence, logits) < 1e-4

    greedy_lengths = (7, 26)
    chunked_lengths, chunk_sizes = (6, 33), (1, 3, 7)
    invariance_lengths = (4, 29, 13, 1)
    mixed_lengths = (3, 21, 10)
    snapshot_length, snapshot_split = 30, 19


def _moves(model, ref, lengths=(23, 40)) -> None:
    """The logits move away from ``ref``'s beyond the tolerance (the part a switch removes matters)."""
    prompts = conf.make_prompts(model.info.vocab_size, lengths, seed=7)
    with pytest.raises(AssertionError):
        conf.check_logits(model, ref, prompts, rtol=1e-4)


@pytest.mark.parametrize(
    "switch",
    [
        {"window_fp8": False},
        {"compressed_fp4": False},
        {"index_fp4": False},
        {"restrict_to_candidates": False},
        {"reuse_selection": False},
        {"engram": False},
        {"single_pass_hc": False},
    ],
)
def test_each_part_moves_the_logits(checkpoint, fp32_pair, switch):
    """The reference with one part switched off disagrees with dgpp: every part is computed."""
    model, _ = fp32_pair
    _moves(model, ReferenceLM(checkpoint, ReferenceOptions(**switch)))


def test_engram_tables_mapped_or_resident_give_the_same_logits(checkpoint, fp32_pair):
    """``engine.ngram_table``: ``mmap`` reads rows from the mapped checkpoint file, ``resident`` from a copy in memory;
    both give the same bits."""
    resident, _ = fp32_pair  # the engine's default
    assert not isinstance(resident.layers[1].engram.table.codes[0], np.memmap)
    mapped = load_model(checkpoint, EngineConfig(ngram_table="mmap"))
    assert isinstance(mapped.layers[1].engram.table.codes[0], np.memmap)
    prompts = conf.make_prompts(mapped.info.vocab_size, (23,), seed=4)
    assert torch.equal(
        conf.engine_all_logits(resident, prompts)[0], conf.engine_all_logits(mapped, prompts)[0]
    )


def test_engine_index_topk_reaches_every_indexer(checkpoint, fp32_pair):
    """``engine.index_topk`` replaces the checkpoint's top-k (4 here) in every index source."""
    model, _ = fp32_pair
    narrower = load_model(checkpoint, EngineConfig(index_topk=2))
    assert {layer.attn.indexer.topk for layer in narrower.layers if layer.attn.indexer is not None} == {2}
    prompts = conf.make_prompts(model.info.vocab_size, (23,), seed=4)
    assert not torch.equal(
        conf.engine_all_logits(narrower, prompts)[0], conf.engine_all_logits(model, prompts)[0]
    )


def test_rows_past_a_rounding_boundary_are_the_only_disagreements(fp32_pair):
    """The default seed's prompts, the one with a window latent channel at an FP8 midpoint included: every row
    agrees within 1e-4 up to the first that does not, and that row holds a decision (a cache rounding or a
    top-k) within 3e-6 of its boundary, where fp32 and float64 may round apart."""
    model, ref = fp32_pair
    prompts = conf.make_prompts(model.info.vocab_size, TestDeepseekV41Conformance.logits_lengths)
    for prompt, logits in zip(prompts, conf.engine_all_logits(model, prompts), strict=True):
        assert assert_matches_reference(ref.ref, prompt, logits) < 1e-4


def test_engram_checkpoint_errors_name_the_file_or_key(checkpoint, tmp_path):
    """Without tokenizer.json the token classes are unknown; bucket sizes that do not sum to the table's rows are
    a config error naming ``engram_num_embeddings``."""
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(checkpoint, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="tokenizer.json"):
        load_model(no_tokenizer)
    wrong_rows = tmp_path / "wrong_rows"
    shutil.copytree(checkpoint, wrong_rows)
    config = json.loads((wrong_rows / "config.json").read_text())
    config["text_config"]["engram_num_embeddings"][0] += 1
    (wrong_rows / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="engram_num_embeddings"):
        load_model(wrong_rows)
