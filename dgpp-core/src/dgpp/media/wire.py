"""A prompt's images as plain JSON data, for the admission journal: tensor-parallel peers rebuild the exact
``PromptMedia`` rank 0 built (processed pixels bit for bit, placeholder spans, rotary positions), so every rank
encodes the same images and keys the prefix cache the same way."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from dgpp.media.prompt import ProcessedImage, PromptImage, PromptMedia


def _tensor_to_wire(t: torch.Tensor) -> dict[str, Any]:
    array = t.contiguous().numpy()
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "b64": base64.b64encode(array.tobytes()).decode(),
    }


def _tensor_from_wire(wire: dict[str, Any]) -> torch.Tensor:
    array = np.frombuffer(base64.b64decode(wire["b64"]), dtype=np.dtype(wire["dtype"])).reshape(wire["shape"])
    return torch.from_numpy(array.copy())


def media_to_wire(media: PromptMedia | None) -> dict[str, Any] | None:
    if media is None:
        return None
    return {
        "images": [
            {
                "pixels": _tensor_to_wire(im.processed.pixels),
                "grid": list(im.processed.grid),
                "tokens": im.processed.num_tokens,
                "start": im.start,
            }
            for im in media.images
        ],
        "rope_positions": _tensor_to_wire(media.rope_positions),
        "rope_delta": media.rope_delta,
    }


def media_from_wire(wire: dict[str, Any] | None) -> PromptMedia | None:
    if wire is None:
        return None
    images = []
    for im in wire["images"]:
        processed = ProcessedImage(_tensor_from_wire(im["pixels"]), tuple(im["grid"]), int(im["tokens"]))
        images.append(PromptImage(processed, int(im["start"]), processed.digest))
    return PromptMedia(images, _tensor_from_wire(wire["rope_positions"]), int(wire["rope_delta"]))
