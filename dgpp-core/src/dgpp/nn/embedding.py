"""Token embedding and LM head (tied to the embedding or not)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.family import World
from dgpp.nn.batch_invariant import batch_invariant_linear
from dgpp.nn.collectives import all_gather_last_dim
from dgpp.nn.second_core import two_core_product
from dgpp.nn.weights import default_weight_loader, set_weight_attrs


class VocabEmbedding(nn.Module):
    """``weight [vocab, hidden]`` lookup. (Vocab sharding under TP lands with dgpp.dist.)"""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the range check reads the ids on the host, which a CUDA-graph capture cannot do
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if (
            input_ids.numel()
            and not capturing
            and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size)
        ):
            raise ValueError(
                f"token id out of range [0, {self.vocab_size}): {input_ids.min()}..{input_ids.max()}"
            )
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden rows -> logits ``[R, vocab]``. With ``tied_to`` the head reuses the embedding matrix, so it
    is loaded once (``named_parameters`` lists the shared tensor only under the embedding).

    Under tensor parallelism (``world.size > 1`` dividing the vocabulary) the head is vocab-parallel:
    each rank holds ``vocab / size`` rows (a view of the tied embedding, or its slice of the checkpoint
    tensor), computes its shard of the logits, and the shards are gathered in rank order."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        tied_to: VocabEmbedding | None = None,
        world: World | None = None,
        group: Any = None,
    ):
        super().__init__()
        self.world, self.group = world or World(), group
        self.vocab_parallel = self.world.size > 1 and vocab_size % self.world.size == 0
        self.vocab_local = vocab_size // self.world.size if self.vocab_parallel else vocab_size
        self.packed: nn.Module | None = (
            None  # a CPU product of packed weights installed at load (engine.gguf_weights)
        )
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            rows = self.vocab_local
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(
                self.weight,
                weight_loader=default_weight_loader,
                tp_dim=0 if self.vocab_parallel else None,
                world=self.world,
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            self.vocab_parallel and weight.shape[0] != self.vocab_local
        ):  # tied: this rank's rows of the embedding
            weight = weight.narrow(0, self.world.rank * self.vocab_local, self.vocab_local)
        logits = _head_gemv(hidden, weight) if hidden.is_cuda else None
        if logits is None and self.packed is not None:
            logits = self.packed(hidden)
        if logits is None and not self.vocab_parallel:  # on the CPU: two cores where one is spare
            logits = two_core_product(hidden, weight)
        if logits is None:
            logits = batch_invariant_linear(hidden, weight)
        return all_gather_last_dim(logits, self.world, self.group) if self.vocab_parallel else logits


def _head_gemv(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    from dgpp.kernels.gemv import lm_head_gemv  # decode rows, opt-in (DGPP_GEMV_HEAD=1)
    from dgpp.nn.exact.routing import always_fixed

    # every row through one fixed-order kernel whatever the row count (a verify's rows, plain decode's, a
    # prompt's last row: dgpp.nn.exact.routing); DGPP_EXACT=0 gives the head back to cuBLAS / the opt-in GEMV
    logits = always_fixed(hidden, weight)
    return logits if logits is not None else lm_head_gemv(hidden, weight)
