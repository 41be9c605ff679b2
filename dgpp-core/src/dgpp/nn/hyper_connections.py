"""Manifold-constrained hyper-connections (mHC): the residual stream widened to ``N`` parallel streams.

A block keeps ``streams [T, N, H]`` instead of one residual row per token. Each sublayer (attention, MLP)
reads the streams through a ``HyperConnection``:

- ``collapse``: an fp32 RMSNorm (no weight) of the flattened ``N*H`` row, one projection ``fn`` to
  ``(2+N)*N`` logits split as ``pre [N] | post [N] | comb [N, N]``, each scaled (``scale[0..2]``) and
  shifted (``base``). ``pre = sigmoid + eps`` weights the streams into the sublayer's input
  ``x = sum_j pre_j * s_j``; ``post = 2 * sigmoid`` and ``comb = sinkhorn(softmax + eps)`` are kept.
- ``expand``: ``s'_k = post_k * out + sum_j comb[j, k] * s_j`` (``comb`` read transposed: it is doubly
  stochastic but not symmetric, and the reference mixes along its first axis).

The Sinkhorn-Knopp projection (``sinkhorn``) alternately normalizes columns and rows so ``comb`` is (close
to) doubly stochastic: mixing the residual streams then neither grows nor shrinks their total. After the
last layer ``HyperHead`` collapses the streams with its own ``sigmoid + eps`` weights (no ``post`` / ``comb``)
before the final norm. DeepSeek-V4 uses two passes per layer (one per sublayer) and the weighted head;
GLM-5.3-Flash and DeepSeek-V4.1 share the coefficient and Sinkhorn math.

Coefficients are computed in fp32 from fp32 parameters; the stream update is rounded to the streams'
dtype as the reference does (``post·out`` rounded, the comb mix summed in fp32 and rounded, then added).
Everything is per row, so a token's streams never depend on the other rows of the step.

Use (per decoder layer, ``T`` rows)::

    streams = to_streams(embeds, N)                       # [T, N, H], every stream = the embedding
    x, post, comb = attn_hc.collapse(streams)             # [T, H]
    streams = attn_hc.expand(streams, attention(norm(x)), post, comb)
    ...
    hidden = head(streams)                                # [T, H], then the final norm and LM head
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.kernels._triton import use_triton
from dgpp.kernels.hyper_connections import hc_collapse, hc_collapse_given, hc_expand, hc_head
from dgpp.kernels.rmsnorm import unweighted_rms_norm
from dgpp.nn.batch_invariant import batch_invariant_linear, batch_invariant_rows
from dgpp.nn.weights import default_weight_loader, set_weight_attrs


class HyperConfig(Protocol):
    """What ``HyperConnection.from_config`` reads from a family's typed config (read-only)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def hc_mult(self) -> int: ...
    @property
    def hc_sinkhorn_iters(self) -> int: ...
    @property
    def hc_eps(self) -> float: ...
    @property
    def rms_norm_eps(self) -> float: ...


def to_streams(hidden: torch.Tensor, streams: int) -> torch.Tensor:
    """``[T, H] -> [T, N, H]``: every stream starts as the same row (the token embedding)."""
    return hidden.unsqueeze(1).expand(-1, streams, -1).contiguous()


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp on positive ``[..., N, N]``: one column pass, then ``iters - 1`` row + column passes.

    Every pass divides by the sum plus ``eps`` (the reference's floor), so the result is doubly stochastic
    up to that floor and the finite iteration count."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _projection(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``flat @ weight.T`` in fp32 with each row's bits independent of the step's other rows."""
    if flat.is_cuda:  # canonical rows through the fixed-order kernel (dgpp.nn.exact.routing)
        from dgpp.nn.exact import routing as exact_cuda

        routed = exact_cuda.routed_linears(flat, [weight], lambda rows: [F.linear(rows, weight)])
        if routed is not None:
            return routed[0]
    return batch_invariant_linear(flat, weight)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return batch_invariant_rows(torch.sigmoid, x)


def _weighted_sum(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_j w[:, j] * s[:, j]`` (``[T, N]`` fp32 weights, ``[T, N, H]`` streams) in fp32, stream order fixed."""
    out = weights[:, 0, None] * streams[:, 0].float()
    for j in range(1, streams.shape[1]):
        out = out + weights[:, j, None] * streams[:, j].float()
    return out


class _StreamNormed(nn.Module):
    """The shared part of ``HyperConnection`` and ``HyperHead``: fp32 parameters, the normed projection.

    The projection's rows (``(2+N)·N`` = 24, or ``N`` = 4 for the head) are off the CUDA GEMV's 16-row tile,
    which would pad a copy of the whole weight on every call; ``settle_weights`` pads it once after loading and
    leaves the parameter a view of the padded rows (``projection_rows``), so no second copy is kept."""

    projection_name = "fn"  # the projection weight's parameter

    def __init__(self, hidden_size: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hidden_size, self.streams, self.eps, self.norm_eps = hidden_size, streams, eps, norm_eps
        self.projection_rows: torch.Tensor | None = None

    def settle_weights(self) -> None:
        """Pads the projection weight's rows to a multiple of 16 with zeros, in place of the per-call pad."""
        weight: nn.Parameter = getattr(self, self.projection_name)
        rows = weight.shape[0]
        if rows % 16 == 0:
            return
        padded = torch.zeros(-(-rows // 16) * 16, weight.shape[1], dtype=weight.dtype, device=weight.device)
        padded[:rows] = weight.data
        weight.data = padded[:rows]
        self.projection_rows = padded

    def _projection_weight(self, fn: torch.Tensor) -> torch.Tensor:
        """``fn``, or its settled padded rows while ``fn`` still views them (a move to another device copies
        the parameter alone: then the padded rows are stale and ``fn`` itself is used)."""
        padded = self.projection_rows
        if (
            padded is None
            or not fn.is_cuda
            or fn.data_ptr() != padded.data_ptr()
            or fn.device != padded.device
        ):
            return fn
        return padded

    def _param(self, *shape: int) -> nn.Parameter:
        p = nn.Parameter(torch.empty(*shape, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(p, weight_loader=default_weight_loader)
        return p

    def _mixes(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        if streams.dim() != 3 or streams.shape[1:] != (self.streams, self.hidden_size):
            raise ValueError(
                f"streams must be [T, {self.streams}, {self.hidden_size}], got {list(streams.shape)}"
            )
        # the streams' fp32 x̂ (on CUDA one launch reads the bf16 streams: no upcast copy)
        flat = unweighted_rms_norm(streams.reshape(streams.shape[0], -1), self.norm_eps, torch.float32)
        weight = self._projection_weight(fn)
        mixes = _projection(flat, weight)
        return mixes if weight is fn else mixes[:, : fn.shape[0]]


class HyperConnection(_StreamNormed):
    """One sublayer's mixing: ``fn [(2+N)*N, N*H]``, ``base [(2+N)*N]``, ``scale [3]`` (all fp32).

    ``sinkhorn_iters``: Sinkhorn-Knopp iterations (DeepSeek-V4: 20); ``eps``: the ``hc_eps`` floor added to
    ``pre`` and ``comb`` and to every Sinkhorn denominator; ``norm_eps``: the RMSNorm epsilon."""

    def __init__(
        self,
        hidden_size: int,
        streams: int = 4,
        *,
        sinkhorn_iters: int = 20,
        eps: float = 1e-6,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__(hidden_size, streams, eps, norm_eps)
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
        self.sinkhorn_iters = sinkhorn_iters
        n = streams
        self.fn = self._param((2 + n) * n, n * hidden_size)
        self.base = self._param((2 + n) * n)
        self.scale = self._param(3)

    @classmethod
    def from_config(cls, cfg: HyperConfig) -> HyperConnection:
        """A sublayer's mixing as the config states it: ``hc_mult`` streams of ``hidden_size``,
        ``hc_sinkhorn_iters``, ``hc_eps``, and ``rms_norm_eps`` for the streams' RMSNorm."""
        return cls(
            cfg.hidden_size,
            cfg.hc_mult,
            sinkhorn_iters=cfg.hc_sinkhorn_iters,
            eps=cfg.hc_eps,
            norm_eps=cfg.rms_norm_eps,
        )

    def coefficients(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre [T, N], post [T, N], comb [T, N, N])`` in fp32 for ``streams [T, N, H]``."""
        return self.coefficients_of(self._mixes(streams, self.fn))

    def coefficients_of(self, mixes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``coefficients`` from the projection's logits ``mixes [T, (2+N)*N]`` (the torch chain)."""
        n, rows = self.streams, mixes.shape[0]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = _sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * _sigmoid(post_w * self.scale[1] + post_b)
        logits = (comb_w * self.scale[2] + comb_b).reshape(rows * n, n)
        comb = batch_invariant_rows(lambda t: torch.softmax(t, dim=-1), logits).reshape(rows, n, n) + self.eps
        return pre, post, sinkhorn(comb, self.sinkhorn_iters, self.eps)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sublayer input ``x [T, H]`` (streams' dtype) and the ``post`` / ``comb`` that ``expand`` needs.
        On CUDA one kernel computes all three from the projection (``dgpp.kernels.hyper_connections``)."""
        mixes = self._mixes(streams, self.fn)
        if use_triton(streams):
            return hc_collapse(
                mixes, self.base, self.scale, streams, sinkhorn_iters=self.sinkhorn_iters, eps=self.eps
            )
        return self.collapse_of(mixes, streams)

    def collapse_of(
        self, mixes: torch.Tensor, streams: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``collapse`` from the projection's logits ``mixes`` (the torch chain)."""
        pre, post, comb = self.coefficients_of(mixes)
        return _weighted_sum(pre, streams).to(streams.dtype), post, comb

    def collapse_given(
        self, streams: torch.Tensor, given_pre: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Single-pass form: ``(x, pre, post, comb)`` with this sublayer's coefficients and ``x`` the streams
        weighted by ``given_pre [T, N]`` (the previous sublayer's ``pre``); one kernel on CUDA."""
        mixes = self._mixes(streams, self.fn)
        if use_triton(streams):
            return hc_collapse_given(
                mixes,
                self.base,
                self.scale,
                streams,
                given_pre,
                sinkhorn_iters=self.sinkhorn_iters,
                eps=self.eps,
            )
        pre, post, comb = self.coefficients_of(mixes)
        return _weighted_sum(given_pre, streams).to(streams.dtype), pre, post, comb

    def expand(
        self, streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """``s'_k = post_k * out + sum_j comb[j, k] * s_j`` for the sublayer output ``out [T, H]``."""
        if use_triton(streams) and out.dtype == streams.dtype:  # else the chain's type promotion decides
            return hc_expand(streams, out, post, comb)
        dtype = streams.dtype
        comb_t = comb.to(dtype).float().transpose(1, 2)  # [T, k, j]: row k mixes the input streams j
        update = post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)
        mixed = torch.stack([_weighted_sum(comb_t[:, k], streams) for k in range(self.streams)], dim=1)
        return update + mixed.to(dtype)

    def forward(self, streams: torch.Tensor, sublayer) -> torch.Tensor:
        """``expand(streams, sublayer(collapse(streams)))``: one sublayer's whole pass."""
        x, post, comb = self.collapse(streams)
        return self.expand(streams, sublayer(x), post, comb)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, streams={self.streams}, sinkhorn_iters={self.sinkhorn_iters}"


class HyperHead(_StreamNormed):
    """The final collapse: ``hc_fn [N, N*H]``, ``hc_base [N]``, ``hc_scale [1]`` (fp32);
    ``x = sum_j (sigmoid(mix_j * scale + base_j) + eps) * s_j``, in the streams' dtype."""

    projection_name = "hc_fn"

    def __init__(
        self, hidden_size: int, streams: int = 4, *, eps: float = 1e-6, norm_eps: float = 1e-6
    ) -> None:
        super().__init__(hidden_size, streams, eps, norm_eps)
        self.hc_fn = self._param(streams, streams * hidden_size)
        self.hc_base = self._param(streams)
        self.hc_scale = self._param(1)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        if use_triton(streams):
            return hc_head(
                self._mixes(streams, self.hc_fn), self.hc_base, self.hc_scale, streams, eps=self.eps
            )
        pre = _sigmoid(self._mixes(streams, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return _weighted_sum(pre, streams).to(streams.dtype)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, streams={self.streams}"
