"""Image embeddings into the token rows of a step: what a family with a vision encoder calls after its token
embedding.

A prompt's image placeholders may be cut by prefill chunk boundaries. The first chunk that reaches an image encodes
it (every pending image of the step in one encoder call) and keeps the rows on the prompt's ``PromptImage``; the
chunk writes the rows its placeholders cover, and the chunk that covers the image's last placeholder drops them.
So the encoder runs once per image however the prompt is chunked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dgpp.media.prompt import ProcessedImage, PromptImage
from dgpp.step.batch import ForwardBatch
from dgpp.step.route import in_flight

Encoder = Callable[[list[ProcessedImage]], list[torch.Tensor]]


def _chunk_images(batch: ForwardBatch) -> list[tuple[int, int, int, PromptImage]]:
    """``(first row of the chunk, its first and end token index, image)`` for every image a sequence's rows reach."""
    found: list[tuple[int, int, int, PromptImage]] = []
    row = 0
    for i, q_len in enumerate(batch.q_lens_cpu):
        media = None if batch.media is None else batch.media[i]
        if media is not None and q_len:
            start = batch.context_lens_cpu[i]
            found += [(row, start, start + q_len, im) for im in media.overlaps(start, start + q_len)]
        row += q_len
    return found


def merge_image_embeddings(hidden: torch.Tensor, batch: ForwardBatch, encode: Encoder) -> torch.Tensor:
    """``hidden`` (the step's token embeddings, ``[T, H]``) with every image placeholder row replaced by its image's
    embedding row (in place); ``encode`` maps processed images to their ``[num_tokens, H]`` rows."""
    reached = _chunk_images(batch)
    pending = list({id(im): im for *_, im in reached if im.embeddings is None}.values())
    if pending:
        with in_flight(None):  # the encoder's rows are patches, not the step's token rows: no token route
            encoded = encode([im.processed for im in pending])
        for image, rows in zip(pending, encoded, strict=True):
            if rows.shape[0] != image.length:
                raise ValueError(
                    f"the encoder gave {rows.shape[0]} rows for an image of {image.length} tokens"
                )
            image.embeddings = rows
    for row, start, end, image in reached:
        assert image.embeddings is not None
        lo, hi = max(image.start, start), min(image.end, end)
        hidden[row + lo - start : row + hi - start] = image.embeddings[
            lo - image.start : hi - image.start
        ].to(hidden.dtype)
        if hi == image.end:
            image.embeddings = None  # every placeholder row is written: a later chunk never needs them
    return hidden
