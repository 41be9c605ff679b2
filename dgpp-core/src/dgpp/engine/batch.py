"""``ForwardBatch`` where plugins import it from: the model contract's step (defined in ``dgpp.step.batch``)."""

from __future__ import annotations

from dgpp.step.batch import ForwardBatch

__all__ = ["ForwardBatch"]
