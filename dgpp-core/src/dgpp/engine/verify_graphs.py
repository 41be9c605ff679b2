"""Speculative verify steps under CUDA graphs: a verify's rows replayed as decode rows.

A verify feeds each request its last token and up to ``depth`` drafts, ``k + 1`` rows at positions ``c .. c + k``,
causal within the request. On CUDA every one of those rows already runs as its own decode row (``dgpp.nn.exact``:
row ``j`` attends to ``c + j + 1`` tokens through the request's table, with the fixed-split kernel plain decode
uses), and the linears take the same row-exact kernels. So the verify of ``B`` requests is a decode step of
``sum(k + 1)`` independent rows, each a one-token item at context ``c + j`` over its request's block table: the
decode graphs (``dgpp.engine.graphs``) replay it in the smallest captured row count that holds it, padding rows
writing nothing (slot -1) and reading nothing (seq_len 0), as for plain decode. A request with fewer drafts
simply has fewer rows; the graph's shape is the padded row count alone. All rows' K/V are stored before any row
attends, as in the eager verify, so row ``j`` reads the drafts before it.

The graph set is one: sized for ``max_batch * (depth + 1)`` rows, it serves the steps where nobody drafts
(``B`` one-row items) and the verifies from the same captured sizes and one memory pool. With a drafter that
reads the target's hidden rows (``Model.keep_hidden``), every replay hands them over from the graph's static
output (``Model.last_hidden``).

Only models whose every cache entry is paged K/V at the rows' positions (``PagedKV``, ``LatentKV``) take it: a
hybrid model's recurrent or conv state, a compressed entry or a window ring advances once per request row by
row, which independent decode rows of one request cannot do; those verify eager.
"""

from __future__ import annotations

from dgpp.engine.work import SeqWork
from dgpp.step.cache_spec import LatentKV, PagedKV
from dgpp.step.model import Model


def verify_rows_independent(model: Model) -> bool:
    """Whether ``model``'s verify rows may run as independent decode rows: no per-request state besides paged
    K/V rows at each row's own position."""
    if model.info.hybrid:
        return False
    return all(type(spec) in (PagedKV, LatentKV) for spec in model.cache_spec().values())


def as_decode_rows(work: list[SeqWork]) -> list[SeqWork] | None:
    """Each row of a verify step as a one-token decode item (row ``j`` of an item at context ``c``: context
    ``c + j``, the item's block table and state slot), in row order; None when an item is a multi-row step that
    is not a verify (a prefill chunk, whose rows want no logits of their own)."""
    rows: list[SeqWork] = []
    for w in work:
        if len(w.token_ids) == 1:
            rows.append(w)
        elif w.every_row_logits and w.media is None:
            rows.extend(
                SeqWork(w.state_slot, w.block_table, w.context_len + j, [token])
                for j, token in enumerate(w.token_ids)
            )
        else:
            return None
    return rows
