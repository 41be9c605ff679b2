"""DeepSeek-V4 weights as shipped: a tiny checkpoint written in the release's quantized layout (FP8 E4M3 with
E8M0 ``.scale`` blocks, MXFP4 routed experts as I8 pairs with E8M0 ``.scale`` per 32, BF16-kept compressors /
indexer weights / head) loads through the family's loader and equals its dequantized twin: every packed
weight decodes bit for bit to what an independent float64 decoder of the block format gives, and the logits
of the two models are identical. Block 128 x 128 is the V4-Flash release's; 32 x 32 (V4.1's) puts several
blocks and partial edge blocks into the tiny matrices."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from dgpp.quant.encode import encode
from dgpp.quant.fp4 import MXFP4
from dgpp.quant.fp8 import FP8Block
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import QuantExperts
from dgpp.quant.scheme import QuantScheme
from dgpp.startup.loading import load_model
from dgpp.testing import conformance as conf
from dgpp.testing.builders import load_reference
from dgpp_deepseek.release_layout import release_hf_config
from dgpp_deepseek.testing import build_tiny_deepseek_v4

transformers.logging.set_verbosity_error()

# E4M3 / E2M1 / E8M0 from their bit fields, in float64 (no torch float8 casts: shares nothing with dgpp.quant)
_E4M3 = np.array(
    [
        np.nan
        if (b & 0x7F) == 0x7F
        else (-1.0) ** (b >> 7)
        * (
            ((b & 7) / 8) * 2.0**-6
            if (b >> 3) & 0xF == 0
            else (1 + (b & 7) / 8) * 2.0 ** (((b >> 3) & 0xF) - 7)
        )
        for b in range(256)
    ]
)
_E2M1 = np.array(
    [
        (-1.0) ** (c >> 3)
        * ((c & 1) * 0.5 if (c >> 1) & 3 == 0 else (1 + (c & 1) / 2) * 2.0 ** (((c >> 1) & 3) - 1))
        for c in range(16)
    ]
)
_E8M0 = np.array([np.nan if b == 255 else 2.0 ** (b - 127) for b in range(256)])


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """value[n, k] = e4m3(code) * 2^(s[n // bn, k // bk] - 127), rounded once to fp32."""
    values = _E4M3[_bytes(weight)]
    grid = _E8M0[_bytes(scale)]
    n, k = values.shape
    scales = np.repeat(np.repeat(grid, block[0], axis=0)[:n], block[1], axis=1)[:, :k]
    return torch.from_numpy((values * scales).astype(np.float32))


def decode_mxfp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Two E2M1 codes per byte (the even column in the low nibble), one E8M0 exponent per 32 columns."""
    packed = _bytes(weight)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    values = _E2M1[codes] * np.repeat(_E8M0[_bytes(scale)], 32, axis=1)
    return torch.from_numpy(values.astype(np.float32))


def release_config(block: tuple[int, int]) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(block),
        "activation_scheme": "dynamic",
    }


def write_release_pair(dense: Path, out: Path, block: tuple[int, int]) -> tuple[Path, Path, dict[str, str]]:
    """The release layout of the dense checkpoint ``dense`` and its dequantized twin (independent decoders);
    returns both and each packed module's format name."""
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"], config["expert_dtype"] = release_config(block), "fp4"
    scheme = QuantScheme.from_hf_config(release_hf_config(config))  # the release's own rule: which are packed
    shipped, twin, packed = {}, {}, {}
    for name, t in load_file(dense / "model.safetensors").items():
        module = name.removesuffix(".weight")
        fmt = (
            scheme.format_for(module)
            if name.startswith("layers.") and name.endswith(".weight") and t.dim() == 2
            else None
        )
        if fmt is None:
            shipped[name] = twin[name] = t
            continue
        enc = encode(fmt, t.float())
        if isinstance(fmt, MXFP4):
            data, scale = (
                enc["weight"].view(torch.int8),
                enc["weight_scale"],
            )  # I8 pairs, as the release stores them
            twin[name] = decode_mxfp4(data, scale)
        else:
            data, scale = enc["weight"], enc["weight_scale_inv"]
            twin[name] = decode_fp8_block(data, scale, block)
        scale = scale.view(torch.float8_e8m0fnu)  # the release's F8_E8M0 scales
        shipped[name], shipped[f"{module}.scale"] = data, scale
        packed[module] = fmt.name
    dirs = []
    for kind, tensors, cfg in (
        ("release", shipped, config),
        ("twin", twin, {k: v for k, v in config.items() if k not in ("quantization_config", "expert_dtype")}),
    ):
        d = out / kind
        d.mkdir(parents=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg))
        dirs.append(d)
    return dirs[0], dirs[1], packed


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    return build_tiny_deepseek_v4(tmp_path_factory.mktemp("dsv4_dense"), seed=3)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)], ids=["v4-flash-128", "blocks-32"])
def test_release_layout_equals_its_dequantized_twin(dense_checkpoint, tmp_path, block):
    release, twin, packed = write_release_pair(dense_checkpoint, tmp_path, block)
    kinds = set(packed.values())
    assert kinds == {"fp8_block", "mxfp4"} and any(".ffn.experts." in m for m in packed)
    assert not any(".compressor." in m or m.endswith("weights_proj") for m in packed)
    model, dense = load_model(release), load_model(twin)
    params = dict(dense.named_parameters())

    # every packed module holds the release's bytes and decodes bit for bit to the independent decoder
    linears = experts = 0
    for name, module in model.named_modules():
        if isinstance(getattr(module, "quant_method", None), QuantLinearMethod):
            method = module.quant_method
            assert (
                isinstance(method.fmt, FP8Block)
                and method.fmt.block == block
                and method.fmt.scale_format == "e8m0"
            )
            got = method.fmt.decode(method.tensors(module), method.local_shape(module), torch.float32)
            assert torch.equal(got, params[f"{name}.weight"]), name
            linears += 1
        elif isinstance(module, QuantExperts):
            assert isinstance(module.fmt, MXFP4)
            want_gate_up = params[f"{name}.gate_up_proj"]
            for e in range(module.num_experts):
                gate_up = torch.cat(
                    [module.expert_weight(p, e, torch.float32) for p in ("gate_proj", "up_proj")]
                )
                assert torch.equal(gate_up, want_gate_up[e]), (name, e)
                assert torch.equal(
                    module.expert_weight("down_proj", e, torch.float32), params[f"{name}.down_proj"][e]
                )
            experts += 1
    assert experts == model.config.num_hidden_layers and linears >= 6 * model.config.num_hidden_layers

    prompts = conf.make_prompts(model.info.vocab_size, (5, 30), seed=4)
    for got, want in zip(
        conf.engine_all_logits(model, prompts), conf.engine_all_logits(dense, prompts), strict=True
    ):
        assert torch.equal(got, want)
    # and the served model agrees with transformers on the same values
    assert conf.check_logits(model, load_reference(twin), prompts, rtol=1e-4) < 1e-4


def test_a_missing_scale_is_refused_naming_the_tensor(dense_checkpoint, tmp_path):
    release, _, packed = write_release_pair(dense_checkpoint, tmp_path, (128, 128))
    tensors = load_file(release / "model.safetensors")
    victim = next(m for m in packed if m.endswith("attn.wq_b"))
    tensors[f"{victim}.weight"] = torch.zeros(tensors[f"{victim}.weight"].shape, dtype=torch.float32)
    del tensors[f"{victim}.scale"]  # a BF16/fp32 weight where the release ships FP8: loaded dense, as stored
    save_file(tensors, release / "model.safetensors", metadata={"format": "pt"})
    model = load_model(release)
    attn = model.get_submodule(victim)
    assert not isinstance(getattr(attn, "quant_method", None), QuantLinearMethod)
    assert torch.count_nonzero(attn.weight) == 0
