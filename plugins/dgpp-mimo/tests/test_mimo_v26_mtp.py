"""MiMo-V2.6's MTP layer (``model.mtp.layers.0``: enorm / hnorm / eh_proj, sliding-window attention with sinks, a
dense MLP, final_layernorm, the main model's embedding and head) through the ``dgpp_build_draft`` hook, loaded
from the fused FP8 layout, judged against a float64 reference written from the spec here and fed transformers' (fp32)
post-final-norm hidden of the dequantized twin."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dgpp.errors import CheckpointError
from dgpp.plugin_api import EngineConfig, PagedKV
from dgpp.plugins import manager
from dgpp.startup.loading import load_context, load_model
from dgpp.testing.builders import load_reference
from dgpp.testing.mtp import draft_logits
from dgpp_mimo.draft import MimoMTPDrafter
from dgpp_mimo.testing import build_tiny_mimo
from dgpp_mimo.testing_v26 import write_v26_checkpoint

RTOL = 1e-4
MTP = "model.mtp.layers.0."


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("mimo_v26_mtp")
    v26, twin = write_v26_checkpoint(
        build_tiny_mimo(root / "flash", seed=11), root / "v26", root / "twin", mtp_layers=1, seed=12
    )
    model = load_model(v26)
    drafter = manager().hook.dgpp_build_draft(ctx=load_context(v26, EngineConfig(mtp=True)), model=model)
    cfg = json.loads((twin / "config.json").read_text())
    return model, drafter, cfg, load_file(str(twin / "model.safetensors")), twin


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, rotary: int, theta: float) -> torch.Tensor:
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rot, rest = x[..., :rotary], x[..., rotary:]
    half = torch.cat([-rot[..., rotary // 2 :], rot[..., : rotary // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


def reference_mtp_logits(
    w: dict, cfg: dict, hidden: torch.Tensor, tokens: torch.Tensor, window: int
) -> torch.Tensor:
    """float64 MTP layer 0: row ``p`` gets the main hidden of ``p`` and token ``p + 1``."""
    w = {k: v.double() for k, v in w.items()}
    eps, n = cfg["rms_norm_eps"], tokens.shape[0]
    heads, kv, d, dv = (
        cfg["num_attention_heads"],
        2 * cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["v_head_dim"],
    )
    rope = cfg["rope_parameters"]["sliding_attention"]
    rotary = int(d * rope["partial_rotary_factor"])
    e = _rms(w["model.embed_tokens.weight"][tokens], w[MTP + "enorm.weight"], eps)
    x = torch.cat([e, _rms(hidden, w[MTP + "hnorm.weight"], eps)], -1) @ w[MTP + "eh_proj.weight"].T
    a = _rms(x, w[MTP + "input_layernorm.weight"], eps)
    pos = torch.arange(n)
    q = _rope((a @ w[MTP + "self_attn.q_proj.weight"].T).view(n, heads, d), pos, rotary, rope["rope_theta"])
    k = _rope((a @ w[MTP + "self_attn.k_proj.weight"].T).view(n, kv, d), pos, rotary, rope["rope_theta"])
    v = (a @ w[MTP + "self_attn.v_proj.weight"].T).view(n, kv, dv) * cfg["attention_value_scale"]
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    out = torch.zeros(n, heads, dv, dtype=torch.float64)
    for p in range(n):
        lo = max(0, p - window + 1)
        scores = torch.einsum("hd,lhd->hl", q[p], k[lo : p + 1]) * d**-0.5
        probs = torch.cat([scores, w[MTP + "self_attn.attention_sink_bias"][:, None]], 1).softmax(-1)[:, :-1]
        out[p] = torch.einsum("hl,lhd->hd", probs, v[lo : p + 1])
    x = x + out.reshape(n, -1) @ w[MTP + "self_attn.o_proj.weight"].T
    b = _rms(x, w[MTP + "pre_mlp_layernorm.weight"], eps)
    gate, up = b @ w[MTP + "mlp.gate_proj.weight"].T, b @ w[MTP + "mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(gate) * up) @ w[MTP + "mlp.down_proj.weight"].T
    return _rms(x, w[MTP + "final_layernorm.weight"], eps) @ w["lm_head.weight"].T


def _main_hidden(twin, tokens: list[int]) -> torch.Tensor:
    hf = load_reference(twin)  # fp32: transformers' grouped expert matmul takes no float64
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0].double()


def test_drafter_loads_the_mtp_layer_paged(loaded):
    _, drafter, _, weights, _ = loaded
    assert isinstance(drafter, MimoMTPDrafter) and len(drafter.layers) == 1
    spec = drafter.cache_spec()
    assert list(spec) == ["mtp.0.self_attn"] and isinstance(spec["mtp.0.self_attn"], PagedKV)
    layer = drafter.layers[0]
    torch.testing.assert_close(layer.eh_proj.weight, weights[MTP + "eh_proj.weight"])
    torch.testing.assert_close(
        layer.post_attention_layernorm.weight, weights[MTP + "pre_mlp_layernorm.weight"]
    )
    assert layer.self_attn.q_proj.quant_method.fmt.name == "fp8_block"  # the fused FP8 qkv, split


@pytest.mark.parametrize("length", [6, 21])  # within the 8-key window, and past it
def test_mtp_logits_match_float64_reference(loaded, length):
    model, drafter, cfg, weights, twin = loaded
    tokens = torch.randint(
        0, cfg["vocab_size"], (length,), generator=torch.Generator().manual_seed(length)
    ).tolist()
    ours = draft_logits(model, drafter, tokens, [length - 1]).double()
    hidden = _main_hidden(twin, tokens[:-1])
    ids = torch.tensor(tokens[1:])
    ref = reference_mtp_logits(weights, cfg, hidden, ids, cfg["sliding_window"])
    rel = float((ours - ref).abs().max() / ref.abs().max())
    assert rel < RTOL, f"MTP logits differ from the float64 reference by {rel:.3g} relative"
    if length > cfg["sliding_window"]:  # the window is load-bearing: one key more is another answer
        wide = reference_mtp_logits(weights, cfg, hidden, ids, cfg["sliding_window"] + 1)
        assert float((ours - wide).abs().max() / wide.abs().max()) > 10 * RTOL


def test_mtp_chunked_prefill_equals_one_shot(loaded):
    model, drafter, cfg, _, _ = loaded
    tokens = torch.randint(0, cfg["vocab_size"], (19,), generator=torch.Generator().manual_seed(3)).tolist()
    one_shot = draft_logits(model, drafter, tokens, [18])
    chunked = draft_logits(model, drafter, tokens, [5, 1, 12])
    torch.testing.assert_close(chunked, one_shot, rtol=1e-5, atol=1e-5)


def test_declared_mtp_layers_must_be_in_the_checkpoint(loaded, tmp_path):
    model, _, _, _, _ = loaded
    root = tmp_path
    v26, _ = write_v26_checkpoint(build_tiny_mimo(root / "flash", seed=2), root / "v26", root / "twin")
    ctx = load_context(v26, EngineConfig(mtp=True))
    assert manager().hook.dgpp_build_draft(ctx=ctx, model=model) is None  # none declared, none built
    config = json.loads((v26 / "config.json").read_text())
    (v26 / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match=r"model\.mtp\.layers\.0\.eh_proj\.weight"):
        manager().hook.dgpp_build_draft(ctx=load_context(v26, EngineConfig(mtp=True)), model=model)
