"""MiMo-V2.6 as shipped (config keys of its own, fused pre-sharded FP8 ``qkv_proj``, MXFP4 experts, FP8 dense MLP,
vision / audio tensors) served by the flash model: it equals its dequantized ``mimo_v2_flash``-layout twin, as
transformers and as dgpp run it, within 1e-4, and 32 greedy tokens agree. The window is the release's: a twin
given one key more (transformers' reading of ``sliding_window_size``) no longer matches."""

from __future__ import annotations

import json

import pytest
import transformers

from dgpp.offline import greedy_generate
from dgpp.quant.fp4 import MXFP4
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.moe import QuantExperts
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_mimo.testing import build_tiny_mimo
from dgpp_mimo.testing_v26 import write_v26_checkpoint

transformers.logging.set_verbosity_error()
# the tiny model's window is 8 keys: 5 fits it, 19 and 26 run past it
LENGTHS = (5, 19, 26)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v26_adapter")
    flash = build_tiny_mimo(root / "flash", seed=6)
    return write_v26_checkpoint(flash, root / "v26", root / "twin", seed=7)


@pytest.fixture(scope="module")
def v26_model(dirs):
    return load_model(dirs[0])


def test_release_formats_load_as_shipped(v26_model):
    layers = v26_model.model.layers
    q, k = layers[0].self_attn.q_proj.quant_method.fmt, layers[0].self_attn.k_proj.quant_method.fmt
    # global layer 0: chunks of Q 192 | K 48 | V 32 rows, so K and V keep 16-row scale blocks of their own
    assert isinstance(q, FP8Block) and q.block == (64, 128) and k.block == (16, 128)
    assert isinstance(layers[0].mlp.gate_proj.quant_method.fmt, FP8Block)
    experts = layers[1].mlp.experts
    assert isinstance(experts, QuantExperts) and all(isinstance(f, MXFP4) for f in experts.formats.values())
    assert not hasattr(layers[0].self_attn.o_proj.quant_method, "fmt")  # BF16 as shipped
    assert float(layers[1].self_attn.sinks.abs().min()) > 0


def test_logits_equal_the_dequantized_twin_in_transformers(v26_model, dirs):
    prompts = conf.make_prompts(v26_model.info.vocab_size, LENGTHS, seed=8)
    assert conf.check_logits(v26_model, load_reference(dirs[1]), prompts, rtol=1e-4) < 1e-4


def test_logits_and_greedy_tokens_equal_the_twin_in_dgpp(v26_model, dirs):
    twin = load_model(dirs[1])
    prompts = conf.make_prompts(v26_model.info.vocab_size, LENGTHS, seed=9)
    for ours, ref in zip(
        conf.engine_all_logits(v26_model, prompts), conf.engine_all_logits(twin, prompts), strict=True
    ):
        assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4
    short = prompts[:2]
    tokens = greedy_generate(v26_model, short, 32)
    assert tokens == greedy_generate(twin, short, 32) and [len(t) for t in tokens] == [32, 32]


def test_the_window_is_the_releases_not_one_key_more(v26_model, dirs, tmp_path):
    """The V2.6 window of 8 keys is the twin's ``sliding_window`` 8; a twin attending 9 differs past the window."""
    config = json.loads((dirs[1] / "config.json").read_text())
    assert (
        json.loads((dirs[0] / "config.json").read_text())["sliding_window_size"]
        == config["sliding_window"]
        == 8
    )
    (tmp_path / "config.json").write_text(json.dumps({**config, "sliding_window": 9}))
    (tmp_path / "model.safetensors").symlink_to(dirs[1] / "model.safetensors")
    prompts = conf.make_prompts(v26_model.info.vocab_size, (26,), seed=10)
    with pytest.raises(AssertionError, match="logits differ"):
        conf.check_logits(v26_model, load_reference(tmp_path), prompts, rtol=1e-4)


def test_split_projection_layout_equals_its_twin(tmp_path):
    """``attention_projection_layout: split``: q/k/v ship as separate FP8 matrices (128-row grids of their own)."""
    v26, twin = write_v26_checkpoint(
        build_tiny_mimo(tmp_path / "flash", seed=13),
        tmp_path / "v26",
        tmp_path / "twin",
        seed=14,
        fused=False,
    )
    model = load_model(v26)
    assert model.model.layers[0].self_attn.k_proj.quant_method.fmt.block == (128, 128)
    prompts = conf.make_prompts(model.info.vocab_size, (19,), seed=15)
    assert conf.check_logits(model, load_reference(twin), prompts, rtol=1e-4) < 1e-4
