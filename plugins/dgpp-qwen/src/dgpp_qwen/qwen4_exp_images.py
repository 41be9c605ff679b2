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

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dgpp.log import get_logger
from dgpp.plugin_api import ConfigError, ImageError, ProcessedImage, PromptImage, PromptMedia

if TYPE_CHECKING:
    from PIL.Image import Image

# Qwen2-VL's processor defaults (OpenAI CLIP statistics), used where preprocessor_config.json is silent
_DEFAULTS: dict[str, Any] = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "resample": 3,  # bicubic
}
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


def as_rgb(image: Image) -> Image:
    """RGB, with any transparency composited onto white."""
    from PIL import Image as PILImage

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _added_tokens(checkpoint_dir: Path) -> dict[int, str]:
    path = checkpoint_dir / "tokenizer.json"
    if not path.exists():
        return {}
    return {t["id"]: t["content"] for t in json.loads(path.read_text()).get("added_tokens", [])}


@dataclass(frozen=True)
class Qwen4ExpImageInput:
    """Preprocessing settings and placeholder tokens of one checkpoint."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float
    resample: int
    image_token_id: int
    start_text: str
    pad_text: str
    end_text: str

    @classmethod
    def from_checkpoint(cls, hf_config: Mapping[str, Any], checkpoint_dir: str | Path) -> Qwen4ExpImageInput:
        directory = Path(checkpoint_dir)
        path = directory / "preprocessor_config.json"
        pre = {**_DEFAULTS, **(json.loads(path.read_text()) if path.exists() else {})}
        for step in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if pre.get(step, True) is not True:
                raise ConfigError(
                    f"{path}: {step} = {pre[step]!r} is not supported (the processor always does it)"
                )
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
        added = _added_tokens(directory)
        missing = [f"{k} {v}" for k, v in ids.items() if v not in added]
        if missing:
            raise ConfigError(f"{directory / 'tokenizer.json'}: no added token for {', '.join(missing)}")
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
            start_text=added[ids["vision_start_token_id"]],
            pad_text=added[ids["image_token_id"]],
            end_text=added[ids["vision_end_token_id"]],
        )

    def process(self, image: Image) -> ProcessedImage:
        factor = self.patch_size * self.merge_size
        rgb = as_rgb(image)
        height, width = smart_resize(rgb.height, rgb.width, factor, self.min_pixels, self.max_pixels)
        resized = np.asarray(rgb.resize((width, height), resample=self.resample)).transpose(2, 0, 1)
        scaled = (resized.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean, std = np.array(self.mean, dtype=np.float32), np.array(self.std, dtype=np.float32)
        normed = ((scaled.T - mean) / std).T
        p, m, grid_h, grid_w = (
            self.patch_size,
            self.merge_size,
            height // self.patch_size,
            width // self.patch_size,
        )
        blocks = normed.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        frames = np.broadcast_to(
            blocks[:, :, :, :, :, None], (*blocks.shape[:5], self.temporal_patch_size, p, p)
        )
        pixels = torch.from_numpy(np.ascontiguousarray(frames).reshape(grid_h * grid_w, -1))
        return ProcessedImage(pixels, (1, grid_h, grid_w), grid_h * grid_w // m**2)

    def placeholder(self, image: ProcessedImage) -> str:
        return self.start_text + self.pad_text * image.num_tokens + self.end_text

    def prompt_media(self, prompt: list[int], images: list[ProcessedImage]) -> PromptMedia:
        ids = torch.tensor(prompt, dtype=torch.int64)
        is_pad = ids == self.image_token_id
        edges = torch.diff(is_pad.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8)).tolist()
        starts = [i for i, e in enumerate(edges) if e == 1]
        if len(starts) != len(images):
            raise ImageError(
                f"the prompt holds {len(starts)} image placeholders for {len(images)} images (is an image "
                "marker written in the text?)"
            )
        placed = []
        for start, image in zip(starts, images, strict=True):
            run = int(is_pad[start : start + image.num_tokens + 1].sum())
            if run != image.num_tokens:
                raise ImageError(f"an image placeholder holds {run} tokens, its image {image.num_tokens}")
            placed.append(PromptImage(image, start, image.digest))
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
