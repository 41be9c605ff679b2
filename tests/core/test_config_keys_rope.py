"""The one RoPE reading (``ConfigKeys.rope`` / ``rotary_dim``) and the one factory (``rotary_embedding``): every
family reads ``rope_parameters`` or ``rope_theta`` + ``rope_scaling`` the same way; a value it cannot serve is a
ConfigError naming the key."""

from __future__ import annotations

import pytest
import torch

from dgpp.checkpoint.config_keys import ConfigKeys
from dgpp.errors import ConfigError
from dgpp.nn.rotary import RopeScaling, TrailingRotary, YarnScaling, default_inv_freq, rotary_embedding


def _keys(**cfg) -> ConfigKeys:
    return ConfigKeys(cfg, "toy config.json")


def test_both_spellings_give_one_rope():
    nested = _keys(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}).rope()
    flat = _keys(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}).rope()
    assert nested == flat and nested.theta == 5e5 and nested.factor == 2.0
    # a nested block without a theta takes the top-level one
    assert _keys(rope_theta=1e6, rope_parameters={"rope_type": "default"}).rope().theta == 1e6


def test_unsupported_values_name_the_key():
    with pytest.raises(
        ConfigError, match=r"toy config.json: 'rope_parameters.rope_type'='dynamic' is not supported"
    ):
        _keys(rope_parameters={"rope_type": "dynamic", "factor": 2.0}).rope()
    with pytest.raises(ConfigError, match=r"'rope_scaling.type'='yarn' is not supported \(default\)"):
        _keys(rope_scaling={"type": "yarn", "factor": 4.0}).rope(supported=("default",))
    with pytest.raises(ConfigError, match="'rope_theta' must be a positive number"):
        _keys(rope_theta=-1.0).rope()
    with pytest.raises(ConfigError, match="'factor' is missing"):
        _keys(rope_parameters={"rope_type": "llama3"}).rope()
    with pytest.raises(ConfigError, match="'partial_rotary_factor'=0.3 gives an odd or empty rotary dim 19"):
        _keys(partial_rotary_factor=0.3).rotary_dim(64)
    assert _keys(rope_parameters={"partial_rotary_factor": 0.5}).rotary_dim(128) == 64
    assert _keys().rotary_dim(128, default_factor=0.5) == 64


def test_the_factory_scales_the_frequencies():
    plain = rotary_embedding(_keys(rope_theta=1e4).rope(), 32)
    linear = rotary_embedding(_keys(rope_scaling={"type": "linear", "factor": 4.0}).rope(), 32)
    assert torch.equal(plain.inv_freq, default_inv_freq(1e4, 32))
    assert torch.equal(linear.inv_freq, default_inv_freq(1e4, 32) / 4.0)
    yarn = rotary_embedding(
        _keys(max_position_embeddings=4096, rope_scaling={"type": "yarn", "factor": 4.0}).rope(), 32, 16
    )
    assert yarn.rotary_dim == 16 and yarn.magnitude > 1.0


def test_a_rope_per_section():
    """MiMo's per-layer-type thetas and DeepSeek-V4's compressed-layer YaRN are entries of ``rope_parameters``."""
    keys = _keys(
        rope_theta=7.0,
        max_position_embeddings=4096,
        rope_parameters={
            "full_attention": {"rope_theta": 5e6, "partial_rotary_factor": 0.5},
            "compress": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            "bare": {"rope_type": "yarn", "factor": 4.0},
        },
    )
    assert keys.rope(section="full_attention").theta == 5e6
    assert keys.rotary_dim(128, section="full_attention") == 64
    assert keys.rotary_dim(128, default_factor=0.25, section="compress") == 32
    compress = keys.rope(section="compress", default_theta=16e4)
    assert compress.theta == 16e4 and compress.yarn is not None and compress.yarn.original_max_position == 64
    assert torch.equal(rotary_embedding(compress, 16).inv_freq, compress.yarn.inv_freq(16e4, 16))
    assert keys.rope(section="bare").original_max_position == 4096  # max_position_embeddings stands in
    with pytest.raises(ConfigError, match="'original_max_position_embeddings' is missing"):
        keys.rope(section="bare", original_fallback=False)
    with pytest.raises(ConfigError, match="'rope_parameters' must hold an entry for 'sliding_attention'"):
        keys.rope(section="sliding_attention")
    with pytest.raises(ConfigError, match="'rope_parameters.compress.rope_type'='yarn' is not supported"):
        keys.rope(("default",), section="compress")


def test_the_factory_builds_the_trailing_variant():
    """``trailing=True``: DeepSeek-V4's rotary on the last dims, bit for bit the module built directly."""
    yarn = YarnScaling(factor=4.0, original_max_position=128, attention_factor=1.0)
    positions, x = torch.arange(0, 700, 7), torch.randn(100, 3, 32).to(torch.bfloat16)
    for rope in (RopeScaling(theta=1e4), RopeScaling(theta=16e4, rope_type="yarn", yarn=yarn)):
        built = rotary_embedding(rope, 32, 8, style="interleaved", trailing=True)
        direct = TrailingRotary(8, rope.theta, yarn=rope.yarn)
        assert isinstance(built, TrailingRotary) and torch.equal(built.inv_freq, direct.inv_freq)
        for inverse in (False, True):
            assert torch.equal(
                built.rotate(x, positions, inverse=inverse), direct.rotate(x, positions, inverse=inverse)
            )
    with pytest.raises(ValueError, match="interleaved"):
        rotary_embedding(RopeScaling(), 32, 8, trailing=True)
