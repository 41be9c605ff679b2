"""Full GLM-5.3's NF4I8 re-encoding (``quant_method: dgpp_nf4i8``): the codebook decodes every level exactly, the
H32 rotation is the normalized Sylvester Hadamard in the format's op order, the config is read as the release
states it (drift refused by key), and a tiny checkpoint in that form serves within 1e-4 of transformers on the
dense weights it defines (and not on the same weights without the rotation)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from dgpp.errors import ConfigError
from dgpp.quant.codebook import NF4I8_LEVELS, NF4Codebook, hadamard32
from dgpp.quant.codecs import pack_int32
from dgpp.quant.intq import IntPacked
from dgpp.quant.scheme import QuantScheme
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp.testing.nf4i8 import nf4i8_quantization, nf4i8_twin, rotation
from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

transformers.logging.set_verbosity_error()

# every codebook matrix and int8 triple needs its input width in whole groups (128 and 64)
SHAPES = {"hidden_size": 128, "moe_intermediate_size": 128, "q_lora_rank": 64, "kv_lora_rank": 64}


def test_every_codebook_level_decodes_exactly():
    index = torch.arange(16).repeat_interleave(8).view(16, 8).repeat(1, 16)  # row r holds index r, 128 wide
    scale = torch.full((16, 1), 0.125, dtype=torch.bfloat16)
    tensors = {"weight_indices": pack_int32(index, 4, dim=1), "weight_scale": scale}
    decoded = NF4Codebook().decode(tensors, (16, 128), torch.float32)
    assert torch.equal(
        decoded, torch.tensor(NF4I8_LEVELS, dtype=torch.float32)[:, None].expand(16, 128) * 0.125
    )


def _butterflies(x: torch.Tensor) -> torch.Tensor:
    """The format's definition element by element: lane i pairs with lane i ^ s at strides 1..16."""
    y = x.float().clone().view(-1, 32)
    for s in (1, 2, 4, 8, 16):
        lanes = torch.arange(32)
        partner = y[:, lanes ^ s]
        y = torch.where((lanes & s) == 0, y + partner, partner - y)
    return (y * torch.tensor(32**-0.5, dtype=torch.float32)).to(x.dtype).view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hadamard32_is_the_normalized_sylvester_rotation_in_the_format_op_order(dtype):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    ours = hadamard32(x)
    assert torch.equal(ours, _butterflies(x))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours.double(), x.double() @ rotation(96), rtol=tol, atol=tol)


def test_release_config_resolves_each_module_and_refuses_drift():
    scheme = QuantScheme.from_hf_config({"quantization_config": nf4i8_quantization(3, 77)})
    assert scheme.format_for("model.layers.3.mlp.experts.255.down_proj") == NF4Codebook()
    assert scheme.format_for("model.layers.77.self_attn.kv_b_proj") == IntPacked(bits=8, group=64)
    assert scheme.format_for("model.layers.40.mlp.shared_experts.gate_proj") == IntPacked(bits=8, group=64)
    for dense in (
        "model.layers.2.self_attn.q_a_proj",
        "model.layers.78.mlp.experts.0.up_proj",
        "model.layers.10.self_attn.indexer.wq_b",
        "model.layers.10.mlp.gate",
        "lm_head",
    ):
        assert scheme.format_for(dense) is None
    for path, value, key in (
        (("routed_experts", "codebook"), [*NF4I8_LEVELS[:-1], 126], "routed_experts.codebook"),
        (("routed_experts", "input_transform", "block_size"), 64, "input_transform.block_size"),
        (("retained_int8", "group_size"), 128, "retained_int8.group_size"),
        (("routed_experts", "layers"), [3, 76], "routed_experts.layers"),
        (("format_version",), 2, "format_version"),
    ):
        qc = json.loads(json.dumps(nf4i8_quantization(3, 77)))
        section = qc
        for part in path[:-1]:
            section = section[part]
        section[path[-1]] = value
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            QuantScheme.from_hf_config({"quantization_config": qc})


@pytest.fixture(scope="module")
def nf4i8_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm_moe_dsa_nf4i8")
    dense = build_tiny_glm_moe_dsa(root / "dense", seed=4, **SHAPES)
    packed, reference = nf4i8_twin(dense, root, 1, 3)
    return load_model(packed), load_reference(reference), root


def test_modules_take_the_nf4i8_forms(nf4i8_pair):
    model, _, _ = nf4i8_pair
    layers = model.model.layers
    assert (
        layers[1].mlp.experts.fmt == NF4Codebook()
        and layers[3].mlp.experts.formats["down_proj"] == NF4Codebook()
    )
    assert layers[2].self_attn.q_b_proj.quant_method.fmt == IntPacked(bits=8, group=64)
    # the int8 kv_b_proj is kept decoded once loaded (MLA absorbs the whole matrix every step: settle_weights)
    assert type(layers[2].self_attn.kv_b_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    assert layers[1].mlp.shared_expert.down_proj.quant_method.fmt == IntPacked(bits=8, group=64)
    assert (
        type(layers[0].self_attn.q_a_proj.quant_method).__name__ == "UnquantizedLinearMethod"
    )  # dense layer 0


def test_nf4i8_logits_match_transformers_on_the_weights_it_defines(nf4i8_pair):
    model, ref, root = nf4i8_pair
    prompts = conf.make_prompts(model.info.vocab_size, (7, 26), seed=12)
    assert conf.check_logits(model, ref, prompts, rtol=1e-4) < 1e-4
    conf.check_greedy(model, ref, conf.make_prompts(model.info.vocab_size, (11,), seed=13), max_new_tokens=12)
    # the same codes read without the rotation are another model: the packed one is not it
    from safetensors.torch import load_file, save_file

    unrotated = load_file(root / "reference" / "model.safetensors")
    packed = load_file(root / "nf4i8" / "model.safetensors")
    for name in [n for n in packed if n.endswith(".weight_indices")]:
        prefix = name[: -len("weight_indices")]
        shape = tuple(packed[prefix + "weight_shape"].tolist())
        own = {k: packed[prefix + k] for k in ("weight_indices", "weight_scale")}
        unrotated[prefix + "weight"] = NF4Codebook().decode(own, shape, torch.float32)
    plain = root / "unrotated"
    plain.mkdir(exist_ok=True)
    save_file(unrotated, plain / "model.safetensors", metadata={"format": "pt"})
    (plain / "config.json").write_text((root / "reference" / "config.json").read_text())
    ours = conf.engine_all_logits(model, prompts)
    other = [conf.reference_logits(load_reference(plain), p) for p in prompts]
    assert max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, other, strict=True)) > 1e-3
