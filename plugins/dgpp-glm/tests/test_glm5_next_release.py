"""GLM-5.3-Flash in its shipped weight forms: ``unsloth/GLM-5.3-Flash-FP8`` (``fp8``: E4M3 with F32 128 x 128
block scales on the DSA attention, dense MLPs, shared and routed experts) and ``HawkBearPig/GLM-5.3-Flash-NVFP4-FP8``
(``dgpp_mixed``: the main stack's routed experts as compressed-tensors NVFP4 triples, the rest the FP8 release's).
The tiny fixture's tensors are checked against the release's table (written here from the original engine's binding,
github.com/HawkBearPig/dgpp src/models/glm), and the packed checkpoint is served equal to its dequantized twin."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dgpp.errors import ConfigError
from dgpp.quant.fp4 import NVFP4CompressedTensors
from dgpp.quant.fp8 import FP8Block
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp_glm.glm5_next_config import Glm5NextArchConfig
from dgpp_glm.testing_glm5_next_release import write_release_checkpoint

F8, U8, F32 = torch.float8_e4m3fn, torch.uint8, torch.float32  # BF16 tensors are F32 in the float32 fixture


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Each variant's packed checkpoint, its twin and the loaded model, built once for the module."""
    built: dict[str, tuple] = {}

    def get(variant: str) -> tuple:
        if variant not in built:
            root = tmp_path_factory.mktemp(f"glm5_next_{variant}")
            packed, twin = write_release_checkpoint(root / "packed", root / "twin", variant=variant, seed=5)
            built[variant] = (variant, packed, twin, load_model(packed))
        return built[variant]

    return get


@pytest.fixture(params=["nvfp4-fp8", "fp8"])
def release(request, releases):
    return releases(request.param)


def _fp8(name: str, rows: int, cols: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {
        name + ".weight": (F8, (rows, cols)),
        name + ".weight_scale_inv": (F32, (-(-rows // 128), -(-cols // 128))),
    }


def _nvfp4(name: str, rows: int, cols: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {
        name + ".weight_packed": (U8, (rows, cols // 2)),
        name + ".weight_scale": (F8, (rows, cols // 16)),
        name + ".weight_global_scale": (F32, (1,)),
    }


def _dense(name: str, *shape: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (F32, shape)}


def release_table(t: dict, nvfp4: bool) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every text tensor the release ships for text config ``t``: name -> (dtype, shape)."""
    h, layers = t["hidden_size"], t["num_hidden_layers"]
    kda, heads = t["linear_num_heads"] * t["linear_head_dim"], t["num_attention_heads"]
    out = {
        **_dense("model.language_model.embed_tokens.weight", t["vocab_size"], h),
        **_dense("lm_head.weight", t["vocab_size"], h),
        **_dense("model.language_model.norm.weight", h),
    }
    for i in range(layers + 1):
        p, mtp = f"model.language_model.layers.{i}.", i == layers
        a = p + "self_attn."
        out.update(_dense(p + "input_layernorm.weight", h) | _dense(p + "post_attention_layernorm.weight", h))
        if mtp:
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                out.update(_dense(f"{p}{norm}.weight", h))
            out.update(_dense(p + "eh_proj.weight", h, 2 * h))
        else:
            for side in ("attn", "ffn"):
                hc = f"{p}hc_{side}_"
                out.update(_dense(hc + "fn", 24, 4 * h) | _dense(hc + "base", 24) | _dense(hc + "scale", 3))
        if not mtp and t["layer_types"][i] == "linear_attention":
            for proj in ("q", "k", "v"):
                out.update(
                    _dense(f"{a}{proj}_proj.weight", kda, h) | _dense(f"{a}{proj}_conv1d.weight", kda, 1, 4)
                )
            d = t["linear_head_dim"]
            out.update(_dense(a + "f_a_proj.weight", d, h) | _dense(a + "g_a_proj.weight", d, h))
            out.update(_dense(a + "f_b_proj.weight", kda, d) | _dense(a + "g_b_proj.weight", kda, d))
            out.update(
                _dense(a + "b_proj.weight", t["linear_num_heads"], h) | _dense(a + "o_proj.weight", h, kda)
            )
            out.update(_dense(a + "A_log", t["linear_num_heads"]) | _dense(a + "dt_bias", kda))
            out.update(_dense(a + "o_norm.weight", d))
        else:
            q_lora, kv_lora, nope, v = (
                t["q_lora_rank"],
                t["kv_lora_rank"],
                t["qk_nope_head_dim"],
                t["v_head_dim"],
            )
            out.update(_fp8(a + "q_a_proj", q_lora, h) | _fp8(a + "q_b_proj", heads * nope, q_lora))
            out.update(_fp8(a + "kv_a_proj_with_mqa", kv_lora, h) | _fp8(a + "o_proj", h, heads * v))
            out.update(_dense(a + "kv_b_proj.weight", heads * (nope + v), kv_lora))
            out.update(
                _dense(a + "q_a_layernorm.weight", q_lora) | _dense(a + "kv_a_layernorm.weight", kv_lora)
            )
            if mtp or t["indexer_types"][i] == "full":
                x, d, n = a + "indexer.", t["index_head_dim"], t["index_n_heads"]
                out.update(_dense(x + "wq_b.weight", n * d, q_lora) | _dense(x + "wk.weight", d, h))
                out.update(_dense(x + "weights_proj.weight", n, h) | _dense(x + "k_norm.weight", d))
                out.update(_dense(x + "k_norm.bias", d) | _dense(x + "index_kpool_compress_gate", d, h))
                out.update(_dense(x + "index_kpool_compress_ape", t["index_kpool"], d))
        m = p + "mlp."
        if not mtp and t["mlp_layer_types"][i] == "dense":
            inter = t["intermediate_size"]
            out.update(
                _fp8(m + "gate_proj", inter, h)
                | _fp8(m + "up_proj", inter, h)
                | _fp8(m + "down_proj", h, inter)
            )
            continue
        inter, experts = t["moe_intermediate_size"], t["n_routed_experts"]
        out.update(
            _dense(m + "gate.weight", experts, h) | _dense(m + "gate.e_score_correction_bias", experts)
        )
        s = m + "shared_experts."
        out.update(
            _fp8(s + "gate_proj", inter, h) | _fp8(s + "up_proj", inter, h) | _fp8(s + "down_proj", h, inter)
        )
        routed = _nvfp4 if nvfp4 and not mtp else _fp8
        for e in range(experts):
            x = f"{m}experts.{e}."
            out.update(
                routed(x + "gate_proj", inter, h)
                | routed(x + "up_proj", inter, h)
                | routed(x + "down_proj", h, inter)
            )
    return out


def test_tensors_are_named_typed_and_shaped_as_the_release_ships(release):
    variant, packed, _, _ = release
    config = json.loads((packed / "config.json").read_text())
    want = release_table(config["text_config"], nvfp4=variant == "nvfp4-fp8")
    with safe_open(str(packed / "model.safetensors"), "pt") as f:
        got = {
            n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
            for n in f.keys()
            if not n.startswith("model.visual.")
        }
    names = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float32: "F32"}
    assert got == {n: (names[d], s) for n, (d, s) in want.items()}
    assert config["quantization_config"]["quant_method"] == (
        "dgpp_mixed" if variant == "nvfp4-fp8" else "fp8"
    )


def test_each_module_takes_its_release_format(release):
    variant, _, _, model = release
    layers = model.stack.layers
    kda, dsa, dense, moe = layers[0].self_attn, layers[1].self_attn, layers[0].mlp, layers[1].mlp
    for linear in (dsa.q_a_proj, dsa.q_b_proj, dsa.kv_a_proj_with_mqa, dsa.o_proj, dense.down_proj):
        assert isinstance(linear.quant_method.fmt, FP8Block) and linear.quant_method.fmt.block == (128, 128)
    assert isinstance(moe.shared_expert.up_proj.quant_method.fmt, FP8Block)
    routed = NVFP4CompressedTensors if variant == "nvfp4-fp8" else FP8Block
    assert isinstance(moe.experts.fmt, routed)
    for linear in (kda.q_proj, kda.o_proj, dsa.kv_b_proj, dsa.indexer.wk):
        assert type(linear.quant_method).__name__ == "UnquantizedLinearMethod"


def test_packed_logits_equal_the_dequantized_twin(release):
    """Served packed, the release computes what its decoded twin computes (prompts of 6 and 19 tokens: the
    indexer's sparse path runs from 12 tokens)."""
    _, _, twin, model = release
    prompts = conf.make_prompts(model.info.vocab_size, (6, 19), seed=11)
    reference = load_model(twin)
    for ours, theirs in zip(
        conf.engine_all_logits(model, prompts), conf.engine_all_logits(reference, prompts), strict=True
    ):
        assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


def test_a_dense_module_missing_from_the_ignore_list_loads_as_the_checkpoint_stores_it(release, tmp_path):
    """The loader reads what is dense from the checkpoint's names (a ``.weight`` without ``.weight_scale_inv``), so
    a ``modules_to_not_convert`` that names only the head still loads the BF16 KDA and indexer projections."""
    variant, packed, _, model = release
    config = json.loads((packed / "config.json").read_text())
    qc = config["quantization_config"]
    (qc["fp8"] if variant == "nvfp4-fp8" else qc)["modules_to_not_convert"] = ["lm_head"]
    short = tmp_path / "short_ignore"
    short.mkdir()
    (short / "model.safetensors").symlink_to(packed / "model.safetensors")
    (short / "config.json").write_text(json.dumps(config))
    prompts = conf.make_prompts(model.info.vocab_size, (9,), seed=12)
    assert torch.equal(
        conf.engine_all_logits(load_model(short), prompts)[0], conf.engine_all_logits(model, prompts)[0]
    )


def test_nvfp4_layers_other_than_the_main_moe_layers_are_refused(releases, tmp_path):
    _, packed, _, _ = releases("nvfp4-fp8")
    config = json.loads((packed / "config.json").read_text())
    cfg = Glm5NextArchConfig.from_hf_config(config)
    config["quantization_config"]["routed_experts"]["layers"].append(cfg.num_hidden_layers)  # the MTP layer's
    bad = tmp_path / "bad_layers"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(packed / "model.safetensors")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"routed_experts\.layers"):
        load_model(bad)
