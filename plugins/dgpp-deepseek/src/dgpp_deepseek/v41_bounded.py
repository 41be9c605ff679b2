"""DeepSeek-V4.1's bounded prefill (``engine.prefill_mode: bounded``, lossy): the causal-encoder layers (those
before the last kv source) run over every row; the decoder layers only over the rows whose logits a step asks for
and the window before them, the decoder's window floored where that run starts.

A sequence's decoder rows in a step are ``[max(done, end - W), end)`` when the step wants one of its logits
(``done``: the position the decoder has run up to), none otherwise. When that start lies past ``done`` the
decoder has a gap, and its window never reads below the start (the floor). The decoder's kv source still
publishes its compressed entries for every row (its input is the encoder's output), so the decoder's selections
see the whole prompt. A request keeps, as state, the encoder output (streams and the collapse coefficients) of
its last ``W`` positions, so a later chunk's run can start inside an earlier chunk: one-shot and chunked prefill
compute the same rows, and a prefix-cache hit restores them with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dgpp.nn.window_compressor import live_sequences
from dgpp.plugin_api import CacheSpec, ForwardBatch, StateSpec

TAIL = "decoder.tail"


def tail_spec(window: int, streams: int, hidden: int, dtype: torch.dtype) -> dict[str, CacheSpec]:
    return {
        TAIL: StateSpec(
            {
                "streams": ((window, streams, hidden), dtype),
                "pre": ((window, streams), torch.float32),
                "marks": ((2,), torch.int64),  # the decoder's run end and its window floor
            }
        )
    }


@dataclass
class DecoderRows:
    """The decoder's sub-step: its batch, its rows' encoder output, where its rows go in the step's hidden rows,
    and each sequence's window floor (by its index in the sub-step)."""

    batch: ForwardBatch
    streams: torch.Tensor
    pre: torch.Tensor
    rows: torch.Tensor  # [n] indices into the step's rows (-1: a row of an earlier step, from the tail)
    floors: dict[int, int]


@dataclass
class _Picked:
    """Per picked sequence: its rows' encoder output, step row ids, positions and its sub-step fields."""

    streams: list[torch.Tensor] = field(default_factory=list)
    pre: list[torch.Tensor] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    ctx_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tables: list[torch.Tensor] = field(default_factory=list)
    floors: dict[int, int] = field(default_factory=dict)


def decoder_rows(batch: ForwardBatch, streams: torch.Tensor, pre: torch.Tensor, window: int) -> DecoderRows:
    """Pick the decoder's rows and keep the encoder output of each sequence's last ``window`` positions."""
    state = batch.cache.state[TAIL]
    wanted = set(batch.logits_indices.tolist())
    picked = _Picked()
    for b, start, q_len, ctx, end, slot in live_sequences(batch):
        lo = max(0, ctx - window)  # the tail: positions lo .. ctx - 1, then this step's rows
        old = torch.arange(lo, ctx, device=streams.device) % window
        line_streams = torch.cat([state["streams"][slot, old], streams[start : start + q_len]])
        line_pre = torch.cat([state["pre"][slot, old], pre[start : start + q_len]])
        line_ids = torch.cat([torch.full((ctx - lo,), -1), torch.arange(start, start + q_len)])
        keep = max(ctx, end - window)
        idx = torch.arange(keep, end, device=streams.device) % window
        state["streams"][slot, idx] = line_streams[keep - lo :]
        state["pre"][slot, idx] = line_pre[keep - lo :]
        done, floor = (int(v) for v in state["marks"][slot].tolist()) if ctx else (0, 0)  # a new request
        if not any(start <= r < start + q_len for r in wanted):
            continue
        first = max(done, end - window)
        if first > done:
            floor = first  # a gap: the decoder rows before ``first`` were never computed
        state["marks"][slot] = torch.tensor([end, floor])
        picked.floors[len(picked.q_lens)] = floor
        picked.streams.append(line_streams[first - lo :])
        picked.pre.append(line_pre[first - lo :])
        picked.rows.append(line_ids[first - lo :])
        picked.positions.append(torch.arange(first, end))
        picked.q_lens.append(end - first)
        picked.ctx_lens.append(first)
        picked.seq_lens.append(end)
        picked.slots.append(int(batch.state_slots[b]))
        picked.tables.append(batch.block_tables[b])
    return _sub_step(batch, picked, streams, pre)


def _sub_step(batch: ForwardBatch, picked: _Picked, streams: torch.Tensor, pre: torch.Tensor) -> DecoderRows:
    device = batch.input_ids.device
    if not picked.rows:
        empty = torch.zeros(0, dtype=torch.int64)
        return DecoderRows(batch, streams[:0], pre[:0], empty, {})
    row_ids = torch.cat(picked.rows)
    pos = torch.cat(picked.positions).to(device)
    # a tail row's token id is not needed: the decoder layers (no Engram) read token ids only to route experts
    # by hash, which V4.1 does not
    ids = torch.where(row_ids >= 0, batch.input_ids[row_ids.clamp_min(0).to(device)].cpu(), 0).to(device)
    qsl = torch.tensor([0, *torch.tensor(picked.q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    sub = ForwardBatch(
        input_ids=ids,
        positions=pos,
        query_start_loc=qsl,
        seq_lens=torch.tensor(picked.seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(picked.ctx_lens, dtype=torch.int32, device=device),
        block_tables=torch.stack(picked.tables),
        slot_mapping=torch.full((int(pos.shape[0]),), -1, dtype=torch.int64, device=device),
        state_slots=torch.tensor(picked.slots, dtype=torch.int64, device=device),
        logits_indices=torch.zeros(0, dtype=torch.int64, device=device),
        cache=batch.cache,
        q_lens_cpu=list(picked.q_lens),
        seq_lens_cpu=list(picked.seq_lens),
        context_lens_cpu=list(picked.ctx_lens),
    )
    return DecoderRows(sub, torch.cat(picked.streams), torch.cat(picked.pre), row_ids, picked.floors)
