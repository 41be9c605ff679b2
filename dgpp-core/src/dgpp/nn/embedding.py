"""Token embedding and LM head (tied to the embedding or not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dgpp.nn.batch_invariant import batch_invariant_linear
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
        if input_ids.numel() and not capturing and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}): {input_ids.min()}..{input_ids.max()}")
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Hidden rows -> logits ``[R, vocab]``. With ``tied_to`` the head reuses the embedding matrix, so it
    is loaded once (``named_parameters`` lists the shared tensor only under the embedding)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, tied_to: VocabEmbedding | None = None):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
            set_weight_attrs(self.weight, weight_loader=default_weight_loader)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return batch_invariant_linear(hidden, self.weight)
