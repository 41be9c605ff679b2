"""Bytes one decode step must move, the benchmark's roofline numerator.

- weights once (``weight_bytes_per_step``: every parameter but the embedding table), except that an MoE
  layer reads only the routed experts its tokens picked: at batch 1 exactly ``top_k``, at batch ``b`` the
  distinct experts among ``b x top_k`` picks (measured from the routers by :class:`RouterTap`, or the
  uniform-routing expectation when not measured), each as its stack stores it (packed experts: their codes and
  scales);
- every sequence's K/V up to its context (paged attention layers); under a DSA indexer (GLM-5.3) each MLA layer
  reads only the ``index_topk`` latent rows selected, and each indexer layer every cached index key once there is
  a choice to make (more than ``index_topk`` tokens);
- every sequence's fixed-size state (Gated DeltaNet recurrent and conv state), read and written back;
- the rows a token looks up in tables held outside the parameters (a module's ``table_bytes_per_token()``, e.g.
  DeepSeek-V4.1's Engram rows), not the whole table.

Cache rows count as ``engine.kv_dtype`` stores them (``dgpp.step.cache_spec.stored_as``): under ``fp8`` e4m3 rows
plus their fp32 row scales, under ``fp4`` packed latent rows, not the compute dtype.
"""

from __future__ import annotations

import math

import torch

from dgpp.nn.dsa import DSAIndexer
from dgpp.nn.linear import Linear
from dgpp.nn.moe import SparseMoE, TopKRouter
from dgpp.quant.linear import QuantLinearMethod
from dgpp.quant.moe import PROJECTIONS, QuantExperts
from dgpp.step.cache_spec import LatentKV, PagedKV, StateSpec, stored_as
from dgpp.step.model import Model


def kv_bytes_per_token(model: Model, kv_dtype: str = "auto") -> int:
    """K/V bytes one token of context adds (all paged attention layers), stored as ``kv_dtype`` says."""
    spec = stored_as(model.cache_spec(), kv_dtype)
    return sum(entry.bytes_per_token() for entry in spec.values() if isinstance(entry, PagedKV))


def state_bytes_per_request(model: Model, kv_dtype: str = "auto") -> int:
    """Fixed-size per-sequence state (GDN recurrent state and conv window; sliding-window rings as ``kv_dtype``
    stores them)."""
    spec = stored_as(model.cache_spec(), kv_dtype)
    return sum(entry.bytes_per_request() for entry in spec.values() if isinstance(entry, StateSpec))


def cache_bytes_per_sequence(model: Model, context: float, kv_dtype: str = "auto") -> float:
    """Cache bytes one sequence's decode step at ``context`` tokens (its new one included) reads, stored as
    ``kv_dtype`` says: every paged entry's rows up to ``context``, except under DSA indexers (GLM-5.3), where an
    MLA latent entry reads the ``topk`` rows selected (all while ``context <= topk``) and an index-key entry all
    its keys once the indexer has a choice to make (``context > topk``); fixed-size state read and written back.
    Raises ``ConfigError`` for a ``kv_dtype`` the model's attention does not read."""
    spec = stored_as(model.cache_spec(), kv_dtype)
    indexers = [m for m in model.modules() if isinstance(m, DSAIndexer)]
    topk = max((m.topk for m in indexers), default=0)
    index_keys = {m.cache_name for m in indexers}
    total = 2.0 * state_bytes_per_request(model, kv_dtype)
    for name, entry in spec.items():
        if not isinstance(entry, PagedKV):
            continue
        rows = context
        if name in index_keys:
            rows = context if context > topk else 0.0
        elif indexers and isinstance(entry, LatentKV):
            rows = min(context, topk)
        total += rows * entry.bytes_per_token()
    return total


def table_bytes_per_token(model: Model) -> int:
    """Bytes one token reads from lookup tables kept outside the parameters (modules with ``table_bytes_per_token``)."""
    return sum(
        int(m.table_bytes_per_token())
        for m in model.modules()
        if callable(getattr(type(m), "table_bytes_per_token", None))
    )


def moe_layers(model: Model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def _module_bytes(module: torch.nn.Module) -> int:
    # packed (quantized) experts count their stored tensors, whatever they are named
    return sum(p.numel() * p.element_size() for p in module.parameters())


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts among ``batch`` tokens' top-k picks if every token picked ``top_k`` of
    ``num_experts`` uniformly at random: ``E (1 - (1 - k/E)^b)`` (exactly ``k`` at batch 1)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_step_bytes(
    model: Model,
    batch: int,
    mean_context: float,
    experts_read: float | None = None,
    kv_dtype: str = "auto",
) -> float:
    """Bytes a decode step of ``batch`` sequences at ``mean_context`` tokens of context reads and writes.
    ``experts_read``: distinct routed experts per MoE layer (None: the uniform-routing expectation); ``kv_dtype``:
    the cache's format (``engine.kv_dtype``)."""
    from dgpp.bench.models import weight_bytes_per_step

    weights = float(weight_bytes_per_step(model))
    for moe in moe_layers(model):
        experts = moe.experts.num_experts
        read = (
            experts_read
            if experts_read is not None
            else expected_distinct_experts(experts, moe.gate.cfg.top_k, batch)
        )
        stack = _module_bytes(moe.experts)
        weights += stack * (min(read, experts) / experts) - stack  # the stack was counted whole
    return (
        weights
        + batch * cache_bytes_per_sequence(model, mean_context, kv_dtype)
        + batch * table_bytes_per_token(model)
    )


class RouterTap:
    """While entered, records the expert ids every router of ``model`` picks (eager forwards only: a
    captured graph runs no Python hooks). ``rows`` limits counting to the first rows (real sequences,
    not graph padding)."""

    def __init__(self, model: Model, rows: int | None = None) -> None:
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.rows = rows
        self.distinct: list[int] = []  # one entry per router call
        self._handles: list = []

    def _hook(self, module: torch.nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        ids = output[1] if self.rows is None else output[1][: self.rows]
        self.distinct.append(int(torch.unique(ids).numel()))

    def __enter__(self) -> RouterTap:
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def mean_distinct(self) -> float:
        """Mean distinct experts per router call (0.0 when nothing was routed)."""
        return sum(self.distinct) / len(self.distinct) if self.distinct else 0.0


def quantized_linears(model: torch.nn.Module) -> dict[str, Linear]:
    """Module name -> every ``Linear`` whose weight is held in a packed format."""
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, Linear) and isinstance(m.quant_method, QuantLinearMethod)
    }


def packed_experts(model: torch.nn.Module) -> dict[str, QuantExperts]:
    """Module name -> every routed-expert stack held in a packed format."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantExperts)}


def expert_elements(experts: torch.nn.Module) -> int:
    """Logical weight elements of an expert stack (``E x 3 x I x H`` on this rank), dense or packed."""
    if isinstance(experts, QuantExperts):
        return experts.num_experts * sum(math.prod(getattr(experts, p).shape) for p in PROJECTIONS)
    return sum(p.numel() for p in experts.parameters())


def logical_weight_elements(model: Model, step_bytes: int) -> int:
    """Weight elements behind ``step_bytes`` (``weight_bytes_per_step``): packed linears and packed expert
    stacks count their logical out x in elements, so FLOP rates do not depend on the storage format."""
    itemsize = torch.empty((), dtype=model.info.dtype).element_size()
    packed_bytes = 0
    logical = 0
    for layer in quantized_linears(model).values():
        packed_bytes += sum(t.numel() * t.element_size() for t in layer.quant_method.tensors(layer).values())
        logical += layer.out_local * layer.in_local
    for experts in packed_experts(model).values():
        packed_bytes += _module_bytes(experts)
        logical += expert_elements(experts)
    return (step_bytes - packed_bytes) // itemsize + logical
