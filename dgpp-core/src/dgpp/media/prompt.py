"""What a prompt with images carries from the server to the model, and the contract a family's image input keeps.

A family that reads images (``ImageInput``) turns a decoded picture into a ``ProcessedImage`` (its encoder's
pixel rows and patch grid, and how many placeholder tokens the picture takes), writes the placeholder text its
chat template expects, and, once the prompt is tokenized, finds each image's placeholder span and builds the
prompt's rotary positions (``PromptMedia``). The engine never looks inside pixels: the model encodes each image
once (``PromptImage.embeddings`` keeps the result for later prefill chunks), the scheduler keys the prefix cache
on ``key_tokens`` (placeholders replaced by the processed pixels' digest) and prefills such a prompt alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One picture as a family's encoder takes it: ``pixels`` (fp32 rows of patches), ``grid`` (the family's patch
    grid, e.g. ``(t, h, w)``) and ``num_tokens`` (placeholder tokens it occupies in the prompt)."""

    pixels: torch.Tensor
    grid: tuple[int, ...]
    num_tokens: int

    @property
    def digest(self) -> bytes:
        """Content key of the processed pixels and their grid: the same picture after the same processing gives
        the same key, any other picture another one."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr(self.grid).encode())
        h.update(memoryview(self.pixels.contiguous().numpy()).cast("B"))  # hashed in place, no copy
        return h.digest()


@dataclass(eq=False)
class PromptImage:
    """An image placed in a prompt: its ``processed`` pixels fill the placeholder tokens ``start .. start+length``.
    ``embeddings`` ``[length, hidden]``: the encoder's output, computed by the first prefill chunk that reaches
    the image and kept for the next chunks (the encoder runs once per image)."""

    processed: ProcessedImage
    start: int
    digest: bytes
    embeddings: torch.Tensor | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return self.processed.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.length


# a placeholder's key token: negative, so no vocabulary id can equal it; one per image, from 7 digest bytes (the
# prefix cache packs tokens as signed 64-bit integers)
def _key_token(digest: bytes) -> int:
    return -1 - int.from_bytes(digest[:7], "little")


@dataclass(eq=False)
class PromptMedia:
    """A prompt's images and its rotary positions. ``rope_positions`` ``[axes, prompt_len]``: the position of every
    prompt token on each rotary axis; a token at index ``p`` past the prompt (generated text) sits at ``p +
    rope_delta`` on every axis."""

    images: list[PromptImage]
    rope_positions: torch.Tensor
    rope_delta: int

    def positions(self, start: int, end: int) -> torch.Tensor:
        """``[axes, end - start]`` rotary positions of tokens ``start .. end`` (prompt or generated)."""
        import torch

        prompt_len = self.rope_positions.shape[1]
        inside = self.rope_positions[:, start : min(end, prompt_len)]
        if end <= prompt_len:
            return inside
        past = torch.arange(max(start, prompt_len), end, dtype=torch.int64) + self.rope_delta
        return torch.cat([inside, past.expand(self.rope_positions.shape[0], -1)], dim=1)

    def key_tokens(self, prompt: list[int]) -> list[int]:
        """``prompt`` with each image's placeholder tokens replaced by a key of its processed pixels: the prefix
        cache hashes and compares these, so the same image and text share a prefix and another image never does."""
        keyed = list(prompt)
        for image in self.images:
            keyed[image.start : image.end] = [_key_token(image.digest)] * image.length
        return keyed

    def overlaps(self, start: int, end: int) -> list[PromptImage]:
        """The images whose placeholders intersect tokens ``start .. end``."""
        return [im for im in self.images if im.start < end and start < im.end]


class ImageError(ValueError):
    """A picture or its placement that a request cannot use; the server answers 400 ``invalid_image``."""


@runtime_checkable
class ImageInput(Protocol):
    """A family's image preprocessing and prompt layout (``dgpp_image_input`` returns one for a checkpoint with a
    vision encoder). ``process`` runs in the server's preparation workers, never on the engine thread."""

    def process(self, image: Image) -> ProcessedImage:
        """Resize, normalise and patchify exactly as the family's own processor does (``ImageError`` when the
        picture cannot be processed, e.g. an extreme aspect ratio)."""
        ...

    def placeholder(self, image: ProcessedImage) -> str:
        """The text the chat template gets for ``image``: the family's image markers with one placeholder token per
        encoder output row."""
        ...

    def prompt_media(self, prompt: list[int], images: list[ProcessedImage]) -> PromptMedia:
        """Locate each image's placeholder span in the tokenized ``prompt`` (in order) and build its rotary
        positions; ``ImageError`` when the spans do not match the images."""
        ...
