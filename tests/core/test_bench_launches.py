"""``dgpp.bench.launches``: what counts as a launch, per layer, and that the fused CUDA path of a real tiny
model launches fewer ops per layer than its unfused chain (``DGPP_KERNELS=torch``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dgpp.bench.launches import count_decode, count_step, layer_kind, tiny_model
from dgpp.policy import overriding


class _Layer(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dgpp.kernels.rmsnorm import rms_norm

        y = x.view(2, -1).reshape(-1)  # views: nothing launches
        torch.empty_like(y)  # an allocation: nothing launches
        if self.inplace:
            y = y.clone()  # one copy
            y.add_(1.0)  # one in-place kernel
        if x.is_cuda:  # answered yes on the counted path
            y = rms_norm(y.view(1, -1), self.weight, 1e-6).view(-1)  # one Triton launch
        float(y.sum().item())  # one reduction and one host read
        return y


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(False), _Layer(True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2.0  # before the first layer: outside
        for layer in self.layers:
            x = layer(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + 1.0


def test_launch_rules_and_attribution() -> None:
    model = _Toy()
    found = count_step(model, lambda: model.compute_logits(model(torch.ones(4))))
    assert dict(found.layers[0]) == {"rms_norm": 1, "aten.sum": 1, "sync:_local_scalar_dense": 1}
    assert dict(found.layers[1]) == {
        "aten.clone": 1,
        "aten.add_": 1,
        "rms_norm": 1,
        "aten.sum": 1,
        "sync:_local_scalar_dense": 1,
    }
    assert dict(found.outside) == {"aten.mul": 1, "aten.add": 1}
    assert found.per_layer() == [3, 5]
    assert not torch.ones(1).is_cuda  # the CUDA answer ends with the count


def test_layer_kind_names_mixer_mlp_and_window() -> None:
    model = tiny_model("mimo")
    kinds = {layer_kind(layer) for layer in model.model.layers}
    assert "MimoAttention+SwiGLUMLP" in kinds
    assert "MimoAttention+SparseMoE/window" in kinds


def test_fused_path_launches_fewer_ops_than_the_unfused_chain() -> None:
    model = tiny_model("qwen3")
    fused = count_decode(model)
    with overriding(triton_kernels=False):  # every kernel's torch reference: the unfused chain
        unfused = count_decode(model)
    assert max(fused.per_layer()) < min(unfused.per_layer())
    for layer in fused.layers:  # residual add + norm, q/k norm + rotary, gate/up + SiLU: one launch each
        assert not any(op in layer for op in ("aten.add", "aten.silu", "aten.rms_norm", "aten.mul"))
        assert layer["qk_norm_rope"] == 1 and layer["gate_up_silu"] == 1


def test_hybrid_and_window_layers_launch_their_fused_kernels() -> None:
    mimo = count_decode(tiny_model("mimo"))
    dense, moe = mimo.layers[0], mimo.layers[1]
    assert "aten.add" not in dense  # both residual adds went into the norms
    assert dense["multi_linear"] == 3  # q/k/v, o, down
    assert moe["align"] == 1 and moe["sum_experts"] == 1 and "aten.argsort" not in moe
    assert moe["router_topk"] == 1 and "aten.topk" not in moe
    qwen = count_decode(tiny_model("qwen3_5_moe"))
    gdn, attention = qwen.layers[0], qwen.layers[1]
    assert gdn["gdn_gates"] == 1 and gdn["gated_rms_norm"] == 1
    assert not any(op in gdn for op in ("aten.softplus", "aten.silu", "aten.rms_norm"))
    # the output gate's and the shared expert's sigmoids are in their kernels
    assert attention["sigmoid_gate"] == 1 and gdn["shared_expert_add"] == attention["shared_expert_add"] == 1
    assert "aten.sigmoid" not in attention and "aten.sigmoid" not in gdn
    assert "sync:_local_scalar_dense" not in gdn and "sync:_local_scalar_dense" not in attention


def test_quantized_cache_writes_are_one_launch_per_tensor() -> None:
    """``engine.kv_dtype`` fp8 (GQA K and V) and fp4 (MLA latents with their k_rot, e4m3 DSA index keys): the cache
    write quantizes and stores in one launch per tensor, none of the torch encoder's ops left."""
    qwen = count_decode(tiny_model("qwen3"), kv_dtype="fp8")
    glm_model = tiny_model("glm_moe_dsa")
    glm = count_decode(glm_model, kv_dtype="fp4")
    for layer in qwen.layers:
        assert layer["quantized_write"] == 2
    for decoder, layer in zip(glm_model.model.layers, glm.layers, strict=True):
        indexed = decoder.self_attn.indexer is not None  # a layer that runs the indexer writes its keys too
        assert layer["quantized_write"] == (2 if indexed else 1)
    for layer in qwen.layers + glm.layers:
        assert not any(op in layer for op in ("aten.amax", "aten.signbit", "write_kv"))


def test_group_limited_router_is_one_launch() -> None:
    glm = count_decode(tiny_model("glm4_moe"))  # 4 groups of 4 experts, the best 2 groups eligible
    moe = glm.layers[1]
    assert moe["router_topk"] == 1
    assert not any(op in moe for op in ("aten.sigmoid", "aten.topk", "aten.sort", "aten.masked_fill"))


def test_pooled_indexer_decode_scores_selects_and_stores_in_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5.3-Flash's attention layers: the k-pooled indexer's scores, picks and expansion are one launch each
    (no sort, argmax or per-row stack left) and its three masked writes one masked store each (no index_copy_),
    so the layer launches fewer ops than with the indexer's decode step on its torch path."""
    from dgpp_glm import glm5_next_indexer_decode

    model = tiny_model("glm5_next")
    fused = count_decode(model)
    monkeypatch.setattr(glm5_next_indexer_decode, "use_triton", lambda x: False)
    unfused = count_decode(model)
    # the layers that run an indexer sort on the torch path (one sharing the previous layer's picks runs none)
    indexed = [i for i, layer in enumerate(unfused.layers) if "aten.sort" in layer]
    assert len(indexed) == sum(type(m).__name__ == "KPoolIndexer" for m in model.modules())
    for i in indexed:
        layer = fused.layers[i]
        assert layer["index_scores"] == layer["top_k_rows"] == layer["pooled_positions"] == 1
        assert layer["store_rows"] == 3
        assert not any(
            f"aten.{op}" in layer for op in ("sort", "argmax", "index_copy_", "bmm", "masked_fill")
        )
        assert sum(layer.values()) < sum(unfused.layers[i].values())


def test_hyper_connections_take_one_launch_per_collapse_and_expand(monkeypatch) -> None:
    from dgpp.nn import hyper_connections

    model = tiny_model("glm5_next", torch.bfloat16)
    fused = count_decode(model)
    monkeypatch.setattr(hyper_connections, "use_triton", lambda _x: False)  # the torch chain
    unfused = count_decode(model)
    for layer, chain in zip(fused.layers, unfused.layers, strict=True):
        assert layer["hc_collapse"] == 2 and layer["hc_expand"] == 2
        # coefficients, 20 Sinkhorn iterations and the stream sums were ~390 torch ops a layer
        assert sum(chain.values()) - sum(layer.values()) > 350
        assert "aten.softmax" in chain and "aten.softmax" not in layer
        assert layer["aten.div"] <= 1 and chain["aten.div"] > 70


def test_single_pass_hyper_connections_take_one_launch_per_collapse_and_expand() -> None:
    for layer in count_decode(tiny_model("deepseek_v41", torch.bfloat16)).layers:
        assert layer["hc_collapse"] == 2 and layer["hc_expand"] == 2
        # the torch chain's Sinkhorn passes were ~78 sums and 78 divisions a layer; router and Engram keep a few,
        # and a ratio-2 compressor's decode rows pool their pair with one softmax of its gates
        assert layer["aten.softmax"] <= 1 and layer["aten.div"] < 20 and layer["aten.sum"] < 20


class _Constants(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.tensor([0.5, 1.0, 2.0, 4.0], device=x.device)  # on a GPU: a host-to-device copy
        offsets = torch.as_tensor([1, 2, 3, 0])  # a CPU vector meets CUDA operands only through a copy
        half = torch.tensor(0.5)  # a zero-dimensional CPU scalar: an operand, nothing copied
        ones = x.new_tensor([1.0, 1.0, 1.0, 1.0])  # on x's device: a copy
        return x * table[offsets] * half * ones


class _ConstantsModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Constants()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def test_tensors_built_from_host_data_count_as_copies_a_graph_refuses() -> None:
    model = _ConstantsModel()
    found = count_step(model, lambda: model(torch.ones(4)))
    assert found.layers[0]["sync:tensor"] == 3
