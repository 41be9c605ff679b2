"""DeepSeek-V4's MoE variants in ``dgpp.nn.moe`` against transformers' modules, same random weights in:
sqrt-softplus scoring with the correction bias and x1.5, hash routing by token id (``tid2eid``) and the
clamped SwiGLU (limit 10) in the routed and the shared experts."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

from dgpp.nn.mlp import SwiGLUMLP
from dgpp.nn.moe import HashRouter, RoutingConfig, SparseMoE

H, E, K, INTER, VOCAB, T = 32, 8, 2, 16, 50, 9


def tiny_config(layers: int = 2) -> DeepseekV4Config:
    return DeepseekV4Config(
        hidden_size=H,
        num_hidden_layers=layers,
        mlp_layer_types=["hash_moe", "moe"][:layers],
        vocab_size=VOCAB,
        n_routed_experts=E,
        num_experts_per_tok=K,
        moe_intermediate_size=INTER,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=8,
        o_lora_rank=8,
        o_groups=2,
        index_n_heads=2,
        index_head_dim=8,
        swiglu_limit=10.0,
        routed_scaling_factor=1.5,
    )


def routing(*, hashed: bool) -> RoutingConfig:
    return RoutingConfig(
        num_experts=E,
        top_k=K,
        scoring="sqrtsoftplus",
        renormalize=True,
        routed_scaling_factor=1.5,
        correction_bias=not hashed,
        hash_vocab_size=VOCAB if hashed else 0,
    )


def paired_blocks(hashed: bool, *, seed: int = 0, weight_scale: float = 1.0, dtype=torch.float32):
    """transformers' block and ours with the same random weights; ``weight_scale`` > 1 drives the SwiGLU
    inputs past the clamp limit."""
    gen = torch.Generator().manual_seed(seed)
    ref = hf.DeepseekV4SparseMoeBlock(tiny_config(), 0 if hashed else 1)
    ours = SparseMoE(
        H, INTER, routing(hashed=hashed), dtype=dtype, shared_intermediate_size=INTER, swiglu_limit=10.0
    )
    values = {
        "gate.weight": torch.randn(E, H, generator=gen),
        "experts.gate_up_proj": torch.randn(E, 2 * INTER, H, generator=gen) * weight_scale,
        "experts.down_proj": torch.randn(E, H, INTER, generator=gen) / INTER**0.5,
        "shared_experts.gate_proj.weight": torch.randn(INTER, H, generator=gen) * weight_scale,
        "shared_experts.up_proj.weight": torch.randn(INTER, H, generator=gen) * weight_scale,
        "shared_experts.down_proj.weight": torch.randn(H, INTER, generator=gen) / INTER**0.5,
    }
    if hashed:  # distinct experts per token, as the release's table has
        values["gate.tid2eid"] = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)])
    else:
        values["gate.e_score_correction_bias"] = torch.randn(E, generator=gen) * 0.5
    ref_params = dict(ref.named_parameters()) | dict(ref.named_buffers())
    for name, value in values.items():
        ref_params[name].data.copy_(value)
        ours.get_parameter(name.replace("shared_experts", "shared_expert")).data.copy_(value)
    return ref.to(dtype), ours


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-5 of the reference's scale (fp32 sums in another order)."""
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def inputs(seed: int = 1, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=gen).to(dtype), torch.randint(0, VOCAB, (T,), generator=gen)


@pytest.mark.parametrize("hashed", [False, True], ids=["topk", "hash"])
def test_block_matches_transformers(hashed):
    ref, ours = paired_blocks(hashed, weight_scale=2.0)
    x, ids = inputs()
    with torch.no_grad():
        want = ref(x.unsqueeze(0), input_ids=ids.unsqueeze(0)).squeeze(0)
        got = ours(x, ids)
        _, want_w, want_ids = (
            ref.gate(x.unsqueeze(0), ids.unsqueeze(0)) if hashed else ref.gate(x.unsqueeze(0))
        )
        got_w, got_ids = ours.gate(x, ids)
    close(got, want)
    # the same experts with the same weights (transformers' top-k is unsorted: compare as sets)
    order_want, order_got = want_ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices))
    assert torch.allclose(got_w.sum(-1), torch.full((T,), 1.5))  # renormalized, then x1.5


def test_router_logits_stay_in_the_model_dtype():
    ref, ours = paired_blocks(False, dtype=torch.bfloat16)
    x, _ = inputs(dtype=torch.bfloat16)
    with torch.no_grad():
        _, want_w, want_ids = ref.gate(x.unsqueeze(0))
        got_w, got_ids = ours.gate(x)
        upcast = torch.nn.functional.softplus(x.float() @ ours.gate.weight.float().T).sqrt()
    assert got_w.dtype == torch.bfloat16
    order_want, order_got = want_ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order_got.values, order_want.values)
    torch.testing.assert_close(
        got_w.gather(1, order_got.indices), want_w.gather(1, order_want.indices), rtol=0, atol=0
    )
    # the scores are those of bf16 logits, not of fp32 ones
    scores = ours.gate.scores(x)
    assert scores.dtype == torch.bfloat16 and not torch.equal(scores.float(), upcast)


def test_hash_routing_follows_the_token_table(monkeypatch):
    ref, ours = paired_blocks(True)
    x, ids = inputs()
    with torch.no_grad():
        want = ref(x.unsqueeze(0), input_ids=ids.unsqueeze(0)).squeeze(0)
        _, picked = ours.gate(x, ids)
        assert torch.equal(picked, ours.gate.tid2eid[ids])
        # without the table (learned top-k on the same gate) the output moves
        monkeypatch.setattr(
            HashRouter, "forward", lambda self, x, token_ids=None: super(HashRouter, self).forward(x)
        )
        learned = ours(x, ids)
    assert (learned - want).abs().max() > 1e-2


def test_hash_router_needs_one_id_per_row():
    _, ours = paired_blocks(True)
    x, ids = inputs()
    with pytest.raises(ValueError, match="one token id per row"):
        ours(x)
    with pytest.raises(ValueError, match="one token id per row"):
        ours(x, ids[:-1])
    with pytest.raises(ValueError, match="hash router"):
        HashRouter(
            H,
            RoutingConfig(num_experts=E, top_k=K, correction_bias=True, hash_vocab_size=VOCAB),
            dtype=torch.float32,
        )


def test_clamp_removed_moves_the_output():
    ref, ours = paired_blocks(False, weight_scale=4.0)
    x, ids = inputs()
    with torch.no_grad():
        gate_up = x @ ours.experts.gate_up_proj[0].T
        assert gate_up.abs().max() > 10  # the weights drive the SwiGLU inputs past the limit
        want = ref(x.unsqueeze(0)).squeeze(0)
        close(ours(x), want)
        ours.experts.swiglu_limit = None
        routed_unclamped = ours(x)
        ours.experts.swiglu_limit, ours.shared_expert.swiglu_limit = 10.0, None
        shared_unclamped = ours(x)
    assert (routed_unclamped - want).abs().max() > 1e-2
    assert (shared_unclamped - want).abs().max() > 1e-2


def test_shared_expert_clamp_matches_transformers_mlp():
    gen = torch.Generator().manual_seed(3)
    ref = hf.DeepseekV4MLP(tiny_config())
    ours = SwiGLUMLP(H, INTER, dtype=torch.float32, swiglu_limit=10.0)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        w = torch.randn(getattr(ref, proj).weight.shape, generator=gen) * 4
        getattr(ref, proj).weight.data.copy_(w)
        getattr(ours, proj).weight.data.copy_(w)
    x, _ = inputs()
    with torch.no_grad():
        close(ours(x), ref(x))
