"""Top-k mixture of experts: router (softmax, sigmoid or sqrt-softplus scoring, optional correction bias,
group-limited top-k, renormalization, routed scaling), or a hash router (experts fixed per token id), fused
SwiGLU experts (optionally clamped, ``swiglu_limit``), and an optional shared expert with an optional
sigmoid gate.

Hash routing (DeepSeek-V4's first layers) picks each token's experts from a frozen ``tid2eid [vocab, k]``
table by the token's id, so its ``forward`` takes the step's token ids next to the hidden rows
(``SparseMoE.forward(x, token_ids)``: a model passes ``batch.input_ids``, one id per row); the learned gate
still weights the picked experts.

Experts are held fused as transformers 5 does in memory (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) and load from either that fused layout or the per-expert tensors
(``experts.N.gate_proj.weight`` ...) that releases store on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from dgpp.family import World
from dgpp.kernels.router_topk import (
    KERNEL_SQRT_SOFTPLUS_DTYPES,
    MAX_EXPERTS,
    RouterTopKInputs,
    pick_experts,
    router_topk,
)
from dgpp.nn.batch_invariant import batch_invariant_linear, batch_invariant_rows, rows_elementwise
from dgpp.nn.linear import Linear
from dgpp.nn.mlp import SwiGLUMLP, silu_and_mul
from dgpp.nn.sources import Alternatives, Source
from dgpp.nn.weights import WeightShapeError, copy_checked, narrow_for_rank, set_weight_attrs


@dataclass(frozen=True)
class RoutingConfig:
    """How tokens pick experts. ``n_group``/``topk_group``: keep only the best ``topk_group`` of
    ``n_group`` expert groups (group score = sum of its top-2 when a correction bias is used, as
    DeepSeek-V3/GLM-4.5, else its max) before the top-k."""

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    router_fp32: bool = False  # compute router logits in fp32 (DeepSeek-V3) instead of the model dtype
    hash_vocab_size: int = 0  # > 0: a hash layer, experts from ``tid2eid [vocab, top_k]`` by token id


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(logits).sqrt()


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-expert scores of router ``logits``: softmax / sigmoid in fp32; sqrt-softplus in the logits' dtype
    (DeepSeek-V4 scores its model-dtype logits as they are). Row-wise ops: a row's bits do not depend on
    the step's other rows."""
    if scoring == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    if (
        scoring == "sigmoid"
    ):  # padded rows: a token's routing weights must not depend on how many tokens share the step
        return batch_invariant_rows(torch.sigmoid, logits.float())
    if scoring == "sqrtsoftplus":
        return batch_invariant_rows(_sqrt_softplus, logits)
    raise ValueError(f"router scoring {scoring!r} is not supported (softmax, sigmoid, sqrtsoftplus)")


def picked_weights(
    scores: torch.Tensor, ids: torch.Tensor, cfg: RoutingConfig, dtype: torch.dtype
) -> torch.Tensor:
    """The routing weights of the picked experts ``ids``: their scores, renormalized, times the routed scale."""
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * cfg.routed_scaling_factor).to(dtype)


class TopKRouter(nn.Module):
    """``weight [E, H]``; returns ``(weights [T, k], expert ids [T, k])``."""

    def __init__(self, hidden_size: int, cfg: RoutingConfig, *, dtype: torch.dtype):
        super().__init__()
        if cfg.num_experts % cfg.n_group:
            raise ValueError(f"num_experts {cfg.num_experts} is not divisible by n_group {cfg.n_group}")
        self.cfg = cfg
        self.weight = nn.Parameter(
            torch.empty(cfg.num_experts, hidden_size, dtype=dtype), requires_grad=False
        )
        if cfg.correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(cfg.num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("e_score_correction_bias", None)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        xr, wr = (x.float(), self.weight.float()) if cfg.router_fp32 else (x, self.weight)
        return _router_logits(xr, wr)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return router_scores(self.logits(x), self.cfg.scoring)

    def one_launch(self, logits: torch.Tensor) -> bool:
        """Whether ``dgpp.kernels.router_topk`` routes ``logits`` (CUDA; up to its expert count; sqrt-softplus
        scores of fp32 or bf16 logits, the roundings it repeats)."""
        sqrt_softplus = self.cfg.scoring == "sqrtsoftplus"
        return (
            logits.is_cuda
            and self.cfg.num_experts <= MAX_EXPERTS
            and (not sqrt_softplus or logits.dtype in KERNEL_SQRT_SOFTPLUS_DTYPES)
        )

    def kernel_inputs(self, logits: torch.Tensor, out_dtype: torch.dtype) -> RouterTopKInputs:
        """The one-launch router's inputs for ``logits`` (``dgpp.kernels.router_topk``)."""
        cfg = self.cfg
        return RouterTopKInputs(
            logits,
            self.e_score_correction_bias,
            cfg.top_k,
            cfg.scoring,
            cfg.renormalize,
            cfg.routed_scaling_factor,
            out_dtype,
            cfg.n_group,
            cfg.topk_group,
        )

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = self.logits(x)
        if self.one_launch(logits):  # scores, bias, group limit, top-k and weights
            return router_topk(self.kernel_inputs(logits, x.dtype))
        scores = router_scores(logits, cfg.scoring)
        choice = scores.float()
        bias = self.e_score_correction_bias
        if bias is not None:
            choice = choice + bias.float()
        ids = pick_experts(choice, cfg.top_k, cfg.n_group, cfg.topk_group, pair_sum=bias is not None)
        return picked_weights(scores, ids, cfg, x.dtype), ids


class HashRouter(TopKRouter):
    """DeepSeek-V4's hash layers: the experts of a token are ``tid2eid[token id]`` (a frozen int64 table
    ``[vocab, top_k]`` the checkpoint ships); the learned ``weight`` scores them as ``TopKRouter`` does
    (no correction bias: selection is not learned). ``forward(x, token_ids)`` needs one id per row."""

    def __init__(self, hidden_size: int, cfg: RoutingConfig, *, dtype: torch.dtype):
        if cfg.hash_vocab_size <= 0 or cfg.correction_bias or cfg.n_group > 1:
            raise ValueError(
                "a hash router needs hash_vocab_size > 0 and no correction bias or expert groups"
            )
        super().__init__(hidden_size, cfg, dtype=dtype)
        self.tid2eid = nn.Parameter(
            torch.zeros(cfg.hash_vocab_size, cfg.top_k, dtype=torch.int64), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if token_ids is None or token_ids.shape != x.shape[:1]:
            got = None if token_ids is None else list(token_ids.shape)
            raise ValueError(f"a hash-routed MoE needs one token id per row ({x.shape[0]}), got {got}")
        logits = self.logits(x)
        if self.one_launch(logits):  # the lookup and the weights
            step = self.kernel_inputs(logits, x.dtype)
            return router_topk(step._replace(hash_table=self.tid2eid, token_ids=token_ids))
        ids = self.tid2eid[token_ids.long()]
        return picked_weights(router_scores(logits, self.cfg.scoring), ids, self.cfg, x.dtype), ids


def _router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:  # one fixed-order kernel for every token count (dgpp.nn.exact.routing): cuBLAS picks by M
        from dgpp.nn.exact.routing import always_fixed

        logits = always_fixed(x, weight)
        if logits is not None:
            return logits
    return batch_invariant_linear(x, weight)


class FusedExperts(nn.Module):
    """``E`` SwiGLU experts; TP splits each expert's intermediate dim (gate/up column, down row).
    ``swiglu_limit``: clamp each expert's SwiGLU inputs (``dgpp.nn.mlp.clamp_swiglu``)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype,
        world: World | None = None,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.world = world or World()
        if intermediate_size % self.world.size:
            raise ValueError(
                f"moe intermediate size {intermediate_size} is not divisible by world {self.world.size}"
            )
        self.num_experts = num_experts
        self.inter = intermediate_size // self.world.size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.inter, hidden_size, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.inter, dtype=dtype), requires_grad=False
        )
        set_weight_attrs(self.gate_up_proj, weight_loader=self._load_gate_up)
        set_weight_attrs(self.down_proj, weight_loader=self._load_down)

    def checkpoint_sources(self) -> dict[str, Alternatives]:
        experts = range(self.num_experts)
        return {
            "gate_up_proj": [
                [Source("gate_up_proj")],
                [Source(f"{e}.{part}_proj.weight", (e, part)) for e in experts for part in ("gate", "up")],
            ],
            "down_proj": [[Source("down_proj")], [Source(f"{e}.down_proj.weight", e) for e in experts]],
        }

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:  # fused [E, 2I, H]: slice each half for this rank
            if loaded.dim() != 3 or loaded.shape[1] % 2:
                raise WeightShapeError(f"shape {list(loaded.shape)} is not a fused [E, 2I, H] gate_up tensor")
            gate, up = loaded.chunk(2, dim=1)
            parts = [narrow_for_rank(t, 1, self.world) for t in (gate, up)]
            copy_checked(param, torch.cat(parts, dim=1))
            return
        expert, part = shard
        rows = slice(0, self.inter) if part == "gate" else slice(self.inter, 2 * self.inter)
        copy_checked(param[expert, rows], narrow_for_rank(loaded, 0, self.world))

    def _load_down(self, param: torch.Tensor, loaded: torch.Tensor, shard: Any = None) -> None:
        if shard is None:
            copy_checked(param, narrow_for_rank(loaded, 2, self.world))
        else:
            copy_checked(param[shard], narrow_for_rank(loaded, 1, self.world))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sum over each token's experts of ``weight · expert(x)``; only experts that were picked run. ``add``
        (CUDA): added to the rounded sum in the sum's launch (a shared expert's output)."""
        if x.is_cuda:  # grouped Triton GEMMs: no per-expert host loop, no sync
            from dgpp import kernels

            return kernels.fused_moe(
                x, self.gate_up_proj, self.down_proj, weights, ids, swiglu_limit=self.swiglu_limit, add=add
            )
        if add is not None:
            raise ValueError("FusedExperts takes an addend on CUDA only (the CPU path adds after the call)")
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            token_idx, slot = torch.where(ids == expert)
            gate, up = batch_invariant_linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = batch_invariant_linear(silu_and_mul(gate, up, self.swiglu_limit), self.down_proj[expert])
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Router + routed experts (+ shared expert, optionally sigmoid-gated). Attribute names follow the
    Qwen checkpoints (``gate``, ``experts``, ``shared_expert``, ``shared_expert_gate``); families with
    other names map them in their loader. ``routing.hash_vocab_size > 0`` makes the gate a ``HashRouter``
    (then ``forward`` needs ``token_ids``); ``swiglu_limit`` clamps the routed and the shared experts alike."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        *,
        dtype: torch.dtype,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        world: World | None = None,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        router = HashRouter if routing.hash_vocab_size > 0 else TopKRouter
        # a prefill row's gate/up/activation width over all ranks: its top-k experts and the shared one
        self.prefill_width = routing.top_k * intermediate_size + shared_intermediate_size
        self.gate = router(hidden_size, routing, dtype=dtype)
        self.experts = FusedExperts(
            routing.num_experts,
            hidden_size,
            intermediate_size,
            dtype=dtype,
            world=world,
            swiglu_limit=swiglu_limit,
        )
        self.shared_expert = (
            SwiGLUMLP(
                hidden_size, shared_intermediate_size, dtype=dtype, world=world, swiglu_limit=swiglu_limit
            )
            if shared_intermediate_size
            else None
        )
        self.shared_expert_gate = (
            Linear(hidden_size, 1, dtype=dtype) if shared_gate and self.shared_expert else None
        )

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``token_ids [T]``: the rows' token ids (``batch.input_ids``); only a hash-routed gate reads them."""
        weights, ids = self.gate(x, token_ids)
        if self.shared_expert is not None and self.shared_expert_gate is None:
            if x.is_cuda and isinstance(self.experts, FusedExperts):  # the add in the expert sum's launch
                return self.experts(x, weights, ids, add=self.shared_expert(x))
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None and out.is_cuda and out.dim() == 2:
                from dgpp import kernels  # the gate's sigmoid, its product and the add in one launch

                return kernels.shared_expert_add(out, shared, self.shared_expert_gate(x))
            if self.shared_expert_gate is not None:
                # a [T, 1] gate: its sigmoid must not put a row in the vector tail by the row count
                shared = rows_elementwise(torch.sigmoid, self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
