"""The DeepSeek-V4 release's quantized layout: which modules are packed, in which format, and the scale names."""

from __future__ import annotations

from dgpp.quant.fp4 import MXFP4
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.scheme import QuantScheme
from dgpp_deepseek.release_layout import dense_modules, release_hf_config, scale_tensor_name

RELEASE_QC = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
CONFIG = {"model_type": "deepseek_v4", "expert_dtype": "fp4", "quantization_config": RELEASE_QC}


def test_scale_names_map_to_the_release():
    assert scale_tensor_name("layers.0.attn.wq_a.weight_scale_inv") == "layers.0.attn.wq_a.scale"
    assert scale_tensor_name("layers.0.ffn.experts.3.w1.weight_scale") == "layers.0.ffn.experts.3.w1.scale"
    assert scale_tensor_name("layers.0.attn.wq_a.weight") == "layers.0.attn.wq_a.weight"
    assert scale_tensor_name("layers.0.hc_attn_scale") == "layers.0.hc_attn_scale"


def test_dense_modules_are_read_from_the_checkpoint():
    names = [
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.wq_a.scale",
        "layers.0.attn.compressor.wkv.weight",
        "head.weight",
        "embed.weight",
        "layers.0.attn_norm.weight",
        "mtp.0.main_proj.weight",
    ]
    assert dense_modules(names) == [
        "embed",
        "head",
        "layers.0.attn.compressor.wkv",
        "layers.0.attn_norm",
        "mtp.0.main_proj",
    ]
    scheme = QuantScheme.from_hf_config(release_hf_config(CONFIG, names))
    assert isinstance(scheme.format_for("layers.0.attn.wq_a"), FP8Block)
    for dense in ("head", "mtp.0.main_proj", "layers.0.attn.compressor.wkv"):
        assert scheme.format_for(dense) is None, dense
    # exact names, not suffixes: a packed module whose name ends like a dense one stays packed
    assert isinstance(scheme.format_for("mtp.0.head"), FP8Block)


def test_release_rule_without_a_checkpoint():
    scheme = QuantScheme.from_hf_config(release_hf_config(CONFIG))
    for dense in (
        "head",
        "layers.2.attn.compressor.wkv",
        "layers.2.attn.compressor.wgate",
        "layers.2.attn.indexer.compressor.wkv",
        "layers.2.attn.indexer.weights_proj",
        "mtp.1.attn.compressor.wgate",
        "layers.2.ffn.gate",
    ):
        assert scheme.format_for(dense) is None, dense
    for fp8 in (
        "layers.2.attn.wq_a",
        "layers.2.attn.wq_b",
        "layers.2.attn.wkv",
        "layers.2.attn.wo_a",
        "layers.2.attn.wo_b",
        "layers.2.attn.indexer.wq_b",
        "layers.2.ffn.shared_experts.w2",
    ):
        fmt = scheme.format_for(fp8)
        assert isinstance(fmt, FP8Block) and fmt.scale_format == "e8m0" and fmt.block == (128, 128), fp8
    assert isinstance(scheme.format_for("layers.2.ffn.experts.255.w3"), MXFP4)


def test_dense_checkpoint_is_left_alone():
    cfg = {"model_type": "deepseek_v4"}
    assert release_hf_config(cfg) is cfg
