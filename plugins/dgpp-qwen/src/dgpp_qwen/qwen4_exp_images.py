"""Qwen3.8-Flash-Next's image input: its processor's preprocessing and its prompt layout (``ImageInput``).

Preprocessing (the checkpoint's ``preprocessor_config.json``, Qwen2-VL's processor): transparency composited onto
white and the picture made RGB; resized with Pillow's bicubic filter to the nearest size whose sides are
multiples of ``patch_size x merge_size`` with a pixel count inside ``[shortest_edge, longest_edge]``
(``smart_resize``); scaled by ``rescale_factor`` in float64, normalised by ``image_mean`` / ``image_std`` in
float32; cut into patches, each repeated ``temporal_patch_size`` times (a still picture is one frame), in merge
block order. An image of an ``h x w`` patch grid takes ``h·w / merge²`` placeholder tokens between
``<|vision_start|>`` and ``<|vision_end|>``.

Positions (multimodal RoPE, three axes: time, row, column): a text token at running position ``p`` sits at ``p``
on every axis; an image starting at ``p`` puts its token of merged row ``r`` and column ``c`` at ``(p, p + r,
p + c)`` and advances the running position by ``max(rows, cols)``.
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
from dgpp.plugin_api import ConfigError, ImageError, ProcessedImage, PromptImage, PromptMedia

if TYPE_CHECKING:
    from PIL.Image import Image

log = get_logger("dgpp.qwen")
MAX_ASPECT_RATIO = 200  # the processor refuses longer-than-200:1 pictures


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized (height, width): sides multiples of ``factor``, area in ``[min_pixels, max_pixels]``, aspect ratio
    as close as those allow."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"the image's aspect ratio {width}x{height} is beyond {MAX_ASPECT_RATIO}:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class Qwen4ExpImageInput(PatchImageInput):
    """Preprocessing settings and placeholder tokens of one checkpoint."""

    min_pixels: int
    max_pixels: int

    @classmethod
    def from_checkpoint(cls, hf_config: Mapping[str, Any], checkpoint_dir: str | Path) -> Qwen4ExpImageInput:
        directory = Path(checkpoint_dir)
        path = directory / "preprocessor_config.json"
        pre = read_preprocessor_config(path, PROCESSOR_DEFAULTS)
        vision = hf_config.get("vision_config") or {}
        patch = int(pre.get("patch_size", vision.get("patch_size", 16)))
        if patch != vision.get("patch_size", 16) or pre["merge_size"] != vision.get("spatial_merge_size", 2):
            raise ConfigError(
                f"{path}: patch_size {patch} / merge_size {pre['merge_size']} disagree with config.json's "
                "vision_config"
            )
        size = pre.get("size") or {}
        ids = {
            key: int(hf_config.get(key, default))
            for key, default in (
                ("image_token_id", 248056),
                ("vision_start_token_id", 248053),
                ("vision_end_token_id", 248054),
            )
        }
        texts = marker_texts(directory, ids)
        return cls(
            patch_size=patch,
            merge_size=int(pre["merge_size"]),
            temporal_patch_size=int(pre["temporal_patch_size"]),
            min_pixels=int(size.get("shortest_edge", pre.get("min_pixels", 56 * 56))),
            max_pixels=int(size.get("longest_edge", pre.get("max_pixels", 28 * 28 * 1280))),
            mean=tuple(pre["image_mean"]),
            std=tuple(pre["image_std"]),
            rescale_factor=float(pre["rescale_factor"]),
            resample=int(pre["resample"]),
            image_token_id=ids["image_token_id"],
            start_text=texts["vision_start_token_id"],
            pad_text=texts["image_token_id"],
            end_text=texts["vision_end_token_id"],
        )

    def process(self, image: Image) -> ProcessedImage:
        factor = self.patch_size * self.merge_size
        rgb = as_rgb(image)
        height, width = smart_resize(rgb.height, rgb.width, factor, self.min_pixels, self.max_pixels)
        resized = np.asarray(rgb.resize((width, height), resample=self.resample)).transpose(2, 0, 1)
        return self.rows(resized)

    def prompt_media(self, prompt: list[int], images: list[ProcessedImage]) -> PromptMedia:
        placed = place_images(prompt, self.image_token_id, images)
        positions, delta = self._rope_positions(len(prompt), placed)
        return PromptMedia(placed, positions, delta)

    def _rope_positions(self, length: int, images: list[PromptImage]) -> tuple[torch.Tensor, int]:
        parts, position, cursor = [], 0, 0
        for image in images:
            text = image.start - cursor
            parts.append(torch.arange(position, position + text).expand(3, -1))
            position += text
            _, h, w = image.processed.grid
            rows, cols = h // self.merge_size, w // self.merge_size
            row = torch.arange(rows).repeat_interleave(cols)
            col = torch.arange(cols).repeat(rows)
            parts.append(torch.stack([torch.zeros_like(row), row, col]) + position)
            position += max(rows, cols)
            cursor = image.end
        parts.append(torch.arange(position, position + length - cursor).expand(3, -1))
        positions = torch.cat(parts, dim=1).to(torch.int64)
        return positions, int(positions.max()) + 1 - length


def image_input(hf_config: Mapping[str, Any], checkpoint_dir: str) -> Qwen4ExpImageInput | None:
    """The ``dgpp_image_input`` hook: a wrapped ``qwen4_exp`` checkpoint with a ``vision_config`` reads images. One
    without ``preprocessor_config.json`` serves text only (its normalisation statistics would be a guess)."""
    if hf_config.get("model_type") != "qwen4_exp" or not hf_config.get("vision_config"):
        return None
    if not (Path(checkpoint_dir) / "preprocessor_config.json").exists():
        log.warning(
            "images refused: the checkpoint has a vision tower but no preprocessor_config.json",
            checkpoint=str(checkpoint_dir),
        )
        return None
    return Qwen4ExpImageInput.from_checkpoint(hf_config, checkpoint_dir)
