"""GLM-5.3-Flash's image input: its processor's preprocessing and its prompt layout (``ImageInput``).

Preprocessing (the checkpoint's ``preprocessor_config.json``, transformers' GLM5-Next image processor): the picture
made RGB (transparency composited onto white). The canvas (``canvas_size``, transformers' ``smart_resize``) is
the aligned size whose sides are multiples of ``factor = patch_size x merge_size x patch_expand_factor`` holding
``min_image_tokens .. max_image_tokens`` blocks of ``factor²`` pixels (a still picture counts as
``temporal_patch_size`` frames); ``patch_expand_factor`` is read as transformers' torchvision processor reads
it (its Pillow processor leaves it out: the two agree at 1). The picture is resized with
Pillow (bicubic) to fit that canvas keeping its aspect ratio (never enlarged unless it is below the token minimum)
and padded with black on the right and bottom. Then scaled by ``rescale_factor`` in float64, normalised by
``image_mean`` / ``image_std`` in float32, cut into patches, each repeated ``temporal_patch_size`` times, in merge
block order. An ``h x w`` patch grid takes ``h·w / merge²`` ``<|image|>`` tokens between ``<|begin_of_image|>`` and
``<|end_of_image|>``.

Positions: the text model has no RoPE, so a prompt's positions are its token indices (one axis, no offset).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dgpp.log import get_logger
from dgpp.media.patches import (
    PROCESSOR_DEFAULTS,
    PatchImageInput,
    as_rgb,
    marker_texts,
    place_images,
    read_preprocessor_config,
)
from dgpp.plugin_api import ConfigError, ImageError, ProcessedImage, PromptMedia

if TYPE_CHECKING:
    from PIL.Image import Image

# defaults where preprocessor_config.json is silent: the shared ones, this processor's patch and token budget
_DEFAULTS: dict[str, Any] = {
    **PROCESSOR_DEFAULTS,
    "patch_size": 14,
    "patch_expand_factor": 1,
    "min_image_tokens": 16,
    "max_image_tokens": 8000,
}
# config.json's marker ids and the release's values
_TOKEN_IDS = (("image_token_id", 154854), ("image_start_token_id", 154830), ("image_end_token_id", 154831))
log = get_logger("dgpp.glm")


def _align(value: int, factor: int) -> int:
    return math.ceil(value / factor) * factor


def canvas_size(
    height: int, width: int, factor: int, frames: int, min_tokens: int, max_tokens: int
) -> tuple[int, int]:
    """The padded canvas (height, width): sides multiples of ``factor``, ``frames x height x width`` within
    ``[min_tokens, max_tokens]`` tokens of ``frames x factor²`` pixels; the largest such canvas of the picture's
    aspect ratio when the aligned picture is over the budget (a binary search on the content height)."""
    per_token = frames * factor**2
    min_pixels, max_pixels = min_tokens * per_token, max_tokens * per_token
    if max_pixels < frames * factor**2:
        raise ImageError(f"max_image_tokens {max_tokens} leaves no room for one aligned patch")
    h, w = _align(height, factor), _align(width, factor)
    if frames * h * w < min_pixels:
        scale = math.sqrt(min_pixels / (frames * height * width))
        h = _align(max(1, math.ceil(height * scale)), factor)
        w = _align(max(1, math.ceil(width * scale)), factor)
    if frames * h * w <= max_pixels:
        return h, w
    best, low, high = (factor, factor), 1, height
    while low <= high:
        content_h = (low + high) // 2
        candidate = (
            _align(content_h, factor),
            _align(max(1, math.floor(width * content_h / height)), factor),
        )
        if frames * candidate[0] * candidate[1] <= max_pixels:
            best, low = candidate, content_h + 1
        else:
            high = content_h - 1
    return best


@dataclass(frozen=True)
class Glm5NextImageInput(PatchImageInput):
    """Preprocessing settings and placeholder tokens of one checkpoint."""

    patch_expand_factor: int
    min_tokens: int
    max_tokens: int

    @classmethod
    def from_checkpoint(cls, hf_config: Mapping[str, Any], checkpoint_dir: str | Path) -> Glm5NextImageInput:
        directory = Path(checkpoint_dir)
        path = directory / "preprocessor_config.json"
        pre = read_preprocessor_config(path, _DEFAULTS)
        vision = hf_config.get("vision_config") or {}
        for ours, theirs, default in (
            ("patch_size", "patch_size", 14),
            ("merge_size", "spatial_merge_size", 2),
            ("temporal_patch_size", "temporal_patch_size", 2),
        ):
            if int(pre[ours]) != vision.get(theirs, default):
                raise ConfigError(
                    f"{path}: {ours} {pre[ours]} disagrees with config.json's vision_config.{theirs}"
                )
        ids = {key: int(hf_config.get(key, default)) for key, default in _TOKEN_IDS}
        texts = marker_texts(directory, ids)
        return cls(
            patch_size=int(pre["patch_size"]),
            merge_size=int(pre["merge_size"]),
            temporal_patch_size=int(pre["temporal_patch_size"]),
            patch_expand_factor=int(pre["patch_expand_factor"]),
            min_tokens=int(pre["min_image_tokens"]),
            max_tokens=int(pre["max_image_tokens"]),
            mean=tuple(pre["image_mean"]),
            std=tuple(pre["image_std"]),
            rescale_factor=float(pre["rescale_factor"]),
            resample=int(pre["resample"]),
            image_token_id=ids["image_token_id"],
            start_text=texts["image_start_token_id"],
            pad_text=texts["image_token_id"],
            end_text=texts["image_end_token_id"],
        )

    @property
    def factor(self) -> int:
        """The canvas sides' multiple: one merge block of patches, times ``patch_expand_factor``."""
        return self.patch_size * self.merge_size * self.patch_expand_factor

    @property
    def max_patches(self) -> int:
        """Patches of the largest canvas the processor makes: ``max_image_tokens`` blocks of ``factor²`` pixels."""
        return self.max_tokens * (self.factor // self.patch_size) ** 2

    def _fit(self, rgb: Image) -> np.ndarray:
        """``[3, H, W]`` uint8: the picture resized into its canvas and padded with black."""
        frames = self.temporal_patch_size
        height, width = rgb.height, rgb.width
        canvas_h, canvas_w = canvas_size(height, width, self.factor, frames, self.min_tokens, self.max_tokens)
        scale = min(canvas_h / height, canvas_w / width)
        if frames * height * width >= frames * self.factor**2 * self.min_tokens:
            scale = min(1.0, scale)  # a picture above the token minimum is never enlarged
        content_h = max(1, min(canvas_h, math.floor(height * scale)))
        content_w = max(1, min(canvas_w, math.floor(width * scale)))
        if (content_h, content_w) != (height, width):
            rgb = rgb.resize((content_w, content_h), resample=self.resample)
        content = np.asarray(rgb).transpose(2, 0, 1)
        return np.pad(content, ((0, 0), (0, canvas_h - content_h), (0, canvas_w - content_w)))

    def process(self, image: Image) -> ProcessedImage:
        return self.rows(self._fit(as_rgb(image)))

    def prompt_media(self, prompt: list[int], images: list[ProcessedImage]) -> PromptMedia:
        placed = place_images(prompt, self.image_token_id, images)
        # no RoPE in the text model: a token's position is its index
        return PromptMedia(placed, torch.arange(len(prompt), dtype=torch.int64)[None], 0)


def image_input(hf_config: Mapping[str, Any], checkpoint_dir: str) -> Glm5NextImageInput | None:
    """The ``dgpp_image_input`` hook: a ``glm5_next`` checkpoint with a ``vision_config`` reads images. One without
    ``preprocessor_config.json`` serves text only (its normalisation statistics would be a guess)."""
    if hf_config.get("model_type") != "glm5_next" or not hf_config.get("vision_config"):
        return None
    if not (Path(checkpoint_dir) / "preprocessor_config.json").exists():
        log.warning(
            "images refused: the checkpoint has a vision tower but no preprocessor_config.json",
            checkpoint=str(checkpoint_dir),
        )
        return None
    return Glm5NextImageInput.from_checkpoint(hf_config, checkpoint_dir)
