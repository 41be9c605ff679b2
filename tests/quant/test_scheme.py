"""quantization_config -> a format per module, and one clear error for anything unsupported."""

from __future__ import annotations

import pytest

from dgpp.errors import ConfigError
from dgpp.hookspecs import hookimpl
from dgpp.quant import module_weight_bytes, packed_bytes
from dgpp.quant.fp4 import MXFP4, NVFP4CompressedTensors, NVFP4ModelOpt
from dgpp.quant.fp8 import FP8Block, FP8Channel
from dgpp.quant.intq import GPTQ, IntPacked
from dgpp.quant.registry import builtin_formats, get_format, registered_formats
from dgpp.quant.scheme import QuantScheme


def scheme(qc: dict) -> QuantScheme:
    return QuantScheme.from_hf_config({"quantization_config": qc})


def test_no_config_means_dense():
    assert QuantScheme.from_hf_config({"model_type": "qwen3"}) is None


def test_fp8_block_with_ignore_list_and_ue8m0():
    s = scheme(
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
        }
    )
    fmt = s.format_for("model.layers.3.self_attn.kv_a_proj_with_mqa")
    assert isinstance(fmt, FP8Block) and fmt.block == (128, 128) and fmt.scale_format == "f32"
    assert fmt.scale_grid((576, 7168)) == (5, 56)  # DeepSeek's 576-row projection: ceil grid
    assert s.format_for("lm_head") is None and s.format_for("model.layers.0.mlp.gate") is None
    e8 = scheme({"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}).format_for(
        "x.q_proj"
    )
    assert e8.scale_format == "e8m0" and e8.block == (32, 32)


def test_fp8_with_mxfp4_experts_deepseek_v4():
    """DeepSeek-V4: E8M0-scaled FP8 blocks everywhere, routed experts (``experts.<id>.``, MTP blocks too) in
    MXFP4 by ``expert_dtype: fp4``, read from quantization_config or, as the release ships it, the top level."""
    qc = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    for cfg in (
        {"quantization_config": {**qc, "expert_dtype": "fp4"}},
        {"expert_dtype": "fp4", "quantization_config": qc},
    ):
        s = QuantScheme.from_hf_config(cfg)
        for name in (
            "layers.3.ffn.experts.7.w1",
            "mtp.0.ffn.experts.12.w2",
            "model.layers.1.mlp.experts.5.up_proj",
        ):
            fmt = s.format_for(name)
            assert isinstance(fmt, MXFP4) and fmt.group == 32 and fmt.scale_kind == "e8m0", name
        for name in ("layers.3.ffn.shared_experts.w1", "layers.3.attn.wq_a", "layers.0.attn.indexer.wq_b"):
            fmt = s.format_for(name)
            assert isinstance(fmt, FP8Block) and fmt.block == (128, 128) and fmt.scale_format == "e8m0", name
    assert isinstance(
        QuantScheme.from_hf_config({"quantization_config": {**qc, "expert_dtype": "fp8"}}).format_for(
            "layers.3.ffn.experts.7.w1"
        ),
        FP8Block,
    )
    with pytest.raises(ConfigError, match="expert_dtype"):
        QuantScheme.from_hf_config({"quantization_config": {**qc, "expert_dtype": "int4"}})


DGPP_MIXED = {
    "quant_method": "dgpp_mixed",
    "routed_experts": {
        "layers": [3, 4, 5],
        "format": "nvfp4-pack-quantized",
        "num_bits": 4,
        "group_size": 16,
        "tensor_suffixes": ["weight_packed", "weight_scale", "weight_global_scale"],
    },
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "re:.*\\.mlp\\.gate$"],
    },
    "mtp_layer": {"index": 6, "source": "base"},
    "dsa_attention": {"layers": [3], "source": "base"},
}


def test_dgpp_mixed_nvfp4_experts_on_the_listed_layers_fp8_blocks_elsewhere():
    """GLM-5.3-Flash NVFP4-FP8: the listed layers' routed experts NVFP4; the MTP layer's experts (layer 6), the
    shared experts and the attention keep the FP8 release's 128 x 128 blocks; the fp8 section's ignore list and
    a top-level one leave modules dense."""
    s = scheme({**DGPP_MIXED, "modules_to_not_convert": ["model.language_model.layers.0.self_attn.q_proj"]})
    p = "model.language_model.layers"
    assert isinstance(s.format_for(f"{p}.4.mlp.experts.287.down_proj"), NVFP4CompressedTensors)
    for name in (
        f"{p}.6.mlp.experts.0.up_proj",
        f"{p}.4.mlp.shared_experts.up_proj",
        f"{p}.3.self_attn.o_proj",
    ):
        fmt = s.format_for(name)
        assert isinstance(fmt, FP8Block) and fmt.block == (128, 128) and fmt.scale_format == "f32", name
    for name in ("lm_head", f"{p}.4.mlp.gate", f"{p}.0.self_attn.q_proj"):
        assert s.format_for(name) is None, name
    assert isinstance(s.format_for(f"{p}.14.mlp.experts.0.up_proj"), FP8Block)  # layer 14 is not layer 4


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"routed_experts": None}, "routed_experts"),
        ({"routed_experts": {**DGPP_MIXED["routed_experts"], "format": "mxfp4"}}, "routed_experts.format"),
        ({"routed_experts": {**DGPP_MIXED["routed_experts"], "group_size": 32}}, "routed_experts.group_size"),
        ({"routed_experts": {**DGPP_MIXED["routed_experts"], "layers": []}}, "routed_experts.layers"),
        ({"mtp_layer": {"source": "experts"}}, "mtp_layer.source"),
        ({"fp8": None}, "quantization_config.fp8"),
        ({"fp8": {"quant_method": "fp8"}}, "quantization_config.fp8.weight_block_size"),
    ],
)
def test_dgpp_mixed_refusals_name_the_key(change, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        scheme({**DGPP_MIXED, **change})


def test_modelopt_nvfp4_excludes_globs():
    s = scheme(
        {
            "quant_method": "modelopt",
            "quantization": {
                "quant_algo": "NVFP4",
                "group_size": 16,
                "exclude_modules": ["lm_head", "*self_attn*"],
            },
        }
    )
    assert isinstance(s.format_for("model.layers.1.mlp.experts.5.up_proj"), NVFP4ModelOpt)
    assert s.format_for("model.layers.1.self_attn.q_proj") is None


def test_compressed_tensors_groups_ignore_first_then_first_match():
    s = scheme(
        {
            "quant_method": "compressed-tensors",
            "format": "mixed",
            "ignore": ["lm_head", "re:.*mlp.gate$"],
            "config_groups": {
                "group_0": {
                    "targets": ["re:.*mlp\\.experts.*"],
                    "format": "nvfp4-pack-quantized",
                    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                },
                "group_1": {
                    "targets": ["re:.*self_attn.*"],
                    "format": "float-quantized",
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                },
                "group_2": {
                    "targets": ["Linear"],
                    "format": "pack-quantized",
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "strategy": "group",
                        "group_size": 64,
                        "symmetric": True,
                    },
                },
            },
        }
    )
    assert isinstance(s.format_for("model.layers.2.mlp.experts.0.down_proj"), NVFP4CompressedTensors)
    assert isinstance(s.format_for("model.layers.2.self_attn.o_proj"), FP8Channel)
    dense_mlp = s.format_for("model.layers.2.mlp.down_proj")
    assert isinstance(dense_mlp, IntPacked) and (dense_mlp.bits, dense_mlp.group) == (4, 64)
    assert s.format_for("model.layers.2.mlp.gate") is None and s.format_for("lm_head") is None


def test_gptq_and_autoround_overrides():
    g = scheme(
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": True,
            "dynamic": {"-:.*shared_expert.*": {}, "+:.*lm_head": {"bits": 8}},
        }
    )
    assert isinstance(g.format_for("model.layers.0.mlp.experts.1.gate_proj"), GPTQ) and g.act_order
    assert g.format_for("model.layers.0.mlp.shared_expert.up_proj") is None
    assert g.format_for("lm_head").bits == 8
    a = scheme(
        {
            "quant_method": "auto-round",
            "bits": 4,
            "group_size": 128,
            "packing_format": "auto_round:auto_gptq",
            "extra_config": {
                "lm_head": {"bits": 8, "group_size": 128},
                "model.layers.0.mlp.gate": {"bits": 16},
            },
        }
    )
    head = a.format_for("lm_head")
    assert isinstance(head, GPTQ) and head.bits == 8 and head.zero_offset == 1
    assert a.format_for("model.layers.0.mlp.gate") is None
    v2 = scheme({"quant_method": "gptq", "bits": 8, "group_size": 128, "checkpoint_format": "gptq_v2"})
    assert v2.format_for("m.q_proj").zero_offset == 0


@pytest.mark.parametrize(
    "qc, key",
    [
        ({"quant_method": "awq"}, "quant_method"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "int",
                            "strategy": "group",
                            "group_size": 128,
                            "symmetric": False,
                        },
                    }
                },
            },
            "symmetric",
        ),
        ({"quant_method": "gptq", "bits": 3}, "bits"),
        ({"quant_method": "auto-round", "packing_format": "auto_round:awq"}, "packing_format"),
    ],
)
def test_unsupported_configs_name_the_key(qc, key):
    with pytest.raises(ConfigError, match=key):
        scheme(qc)


def test_registry_and_packed_bytes():
    names = {f.name for f in builtin_formats()}
    assert names <= set(registered_formats())
    assert {
        "fp8_block",
        "fp8_channel",
        "nvfp4_modelopt",
        "nvfp4_ct",
        "mxfp4",
        "int_packed",
        "gptq",
        "nf4i8",
        "bf12",
    } == names
    with pytest.raises(ConfigError, match="unknown weight format"):
        get_format("nf4")
    n, k = 4096, 12288
    assert packed_bytes("fp8_block", (n, k)) == n * k + 32 * 96 * 4
    assert (
        packed_bytes(get_format("fp8_block", block=(128, 128), scale_format="bf16"), (576, 7168))
        == 576 * 7168 + 5 * 56 * 2
    )
    assert packed_bytes("nvfp4_modelopt", (n, k)) == n * k // 2 + n * k // 16 + 4
    assert packed_bytes(MXFP4(), (n, k)) == n * k // 2 + n * k // 32
    assert packed_bytes(IntPacked(bits=4, group=64), (n, k)) == n * k // 2 + n * k // 64 * 2
    assert (
        packed_bytes(GPTQ(bits=4, group=128), (n, k))
        == n * k // 2 + (k // 128) * n // 8 * 4 + (k // 128) * n * 2
    )
    assert packed_bytes("bf12", (n, k)) == n * k * 3 // 2 + n + (n + 1) * 4


def test_module_weight_bytes_for_the_memory_plan():
    s = scheme({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["*self_attn*"]})
    assert module_weight_bytes(s, "model.layers.0.self_attn.q_proj", (64, 64), 2) == 64 * 64 * 2
    assert module_weight_bytes(s, "model.layers.0.mlp.experts.1.up_proj", (32, 64), 2) == 32 * 32 + 32 * 4 + 4
    assert module_weight_bytes(None, "lm_head", (512, 64), 4) == 512 * 64 * 4


class _PluginFP8(FP8Block):
    name = "plugin_fp8"  # a format only a plugin registers


class _FormatPlugin:
    @hookimpl
    def dgpp_quant_formats(self):
        return [_PluginFP8()]


def test_plugin_formats_are_handed_in_by_the_plugin_manager(monkeypatch):
    """The registry knows what ``dgpp.plugins.manager()`` hands it, and names the missing hand-off before that."""
    from dgpp import handoff
    from dgpp.plugins import manager

    monkeypatch.setattr(handoff, "_format_answers", None)
    assert "fp8_block" in registered_formats()  # core's built-ins need no wiring
    with pytest.raises(ConfigError, match="plugin formats are not registered yet"):
        get_format("plugin_fp8")
    pm = manager.__wrapped__()  # a fresh process-wide manager, as an entry point builds it
    pm.register(_FormatPlugin(), name="format-plugin")  # before the first lookup through this manager
    assert isinstance(get_format("plugin_fp8"), _PluginFP8)
    assert get_format("plugin_fp8", block=(64, 64)).block == (64, 64)
