"""The steps that Qwen2-VL-style image processors share, for a family's ``ImageInput`` to compose.

Such a processor reads ``preprocessor_config.json`` over its own defaults (``read_preprocessor_config``), makes the
picture RGB with transparency composited onto white (``as_rgb``), sizes it its own way, then scales, normalises and
cuts it into patch rows in merge-block order (``patch_rows``); ``PatchImageInput`` holds the settings those steps
read and the placeholder text. Its placeholder markers are added tokens of
``tokenizer.json`` (``marker_texts``); once a prompt is tokenized, each image owns one run of image tokens
(``place_images``). What differs between families (the resize rule, the marker ids, the rotary positions) stays in
the family.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dgpp.errors import ConfigError
from dgpp.media.prompt import ImageError, ProcessedImage, PromptImage

if TYPE_CHECKING:
    from PIL.Image import Image

# such processors' defaults where preprocessor_config.json is silent: OpenAI CLIP's statistics, 8-bit scaling,
# 2 x 2 merge blocks, 2 frames per still picture, Pillow's bicubic filter
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "resample": 3,
}
# preprocessing steps such a processor always does: a config that turns one off is refused
_ALWAYS_DONE = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


def read_preprocessor_config(path: Path, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``path``'s keys over ``defaults`` (``defaults`` alone when the file is absent); a ConfigError naming the file
    and key when it turns off a step the processor always does."""
    pre = {**defaults, **(json.loads(path.read_text()) if path.exists() else {})}
    for step in _ALWAYS_DONE:
        if pre.get(step, True) is not True:
            raise ConfigError(
                f"{path}: {step} = {pre[step]!r} is not supported (the processor always does it)"
            )
    return pre


def as_rgb(image: Image) -> Image:
    """RGB, with any transparency composited onto white."""
    from PIL import Image as PILImage

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def marker_texts(checkpoint_dir: Path, ids: Mapping[str, int]) -> dict[str, str]:
    """The text of each marker (name -> token id) among ``tokenizer.json``'s added tokens; a ConfigError naming
    the file and every id it lacks."""
    path = checkpoint_dir / "tokenizer.json"
    added = (
        {t["id"]: t["content"] for t in json.loads(path.read_text()).get("added_tokens", [])}
        if path.exists()
        else {}
    )
    missing = [f"{k} {v}" for k, v in ids.items() if v not in added]
    if missing:
        raise ConfigError(f"{path}: no added token for {', '.join(missing)}")
    return {key: added[token] for key, token in ids.items()}


def patch_rows(
    pixels: np.ndarray,
    *,
    rescale_factor: float,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
) -> ProcessedImage:
    """``pixels`` ``[3, H, W]`` uint8 (sides multiples of ``patch_size x merge_size``) as the encoder's rows: scaled
    by ``rescale_factor`` in float64, normalised by ``mean`` / ``std`` in float32, one row per patch (each patch
    repeated ``temporal_patch_size`` times: a still picture is one frame), ``merge_size²`` consecutive rows per merge
    block, blocks row-major. Grid ``(1, H / patch, W / patch)``; one placeholder token per merge block."""
    scaled = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    mean_, std_ = np.array(mean, dtype=np.float32), np.array(std, dtype=np.float32)
    normed = ((scaled.T - mean_) / std_).T
    p, m = patch_size, merge_size
    grid_h, grid_w = pixels.shape[1] // p, pixels.shape[2] // p
    blocks = normed.reshape(3, grid_h // m, m, p, grid_w // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], temporal_patch_size, p, p))
    rows = torch.from_numpy(np.ascontiguousarray(frames).reshape(grid_h * grid_w, -1))
    return ProcessedImage(rows, (1, grid_h, grid_w), grid_h * grid_w // m**2)


def place_images(prompt: list[int], image_token_id: int, images: list[ProcessedImage]) -> list[PromptImage]:
    """Each image at its run of ``image_token_id`` tokens, in prompt order; an ImageError when the runs and the
    images do not match one to one (count or length)."""
    is_pad = torch.tensor(prompt, dtype=torch.int64) == image_token_id
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
    return placed


@dataclass(frozen=True)
class PatchImageInput:
    """Settings shared by such processors (a family's ``ImageInput`` extends it with its resize settings):
    patch geometry, normalisation, Pillow's resample filter, and the placeholder markers' id and texts."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale_factor: float
    resample: int
    image_token_id: int
    start_text: str
    pad_text: str
    end_text: str

    def rows(self, pixels: np.ndarray) -> ProcessedImage:
        """``patch_rows`` of ``pixels`` ``[3, H, W]`` uint8 with these settings."""
        return patch_rows(
            pixels,
            rescale_factor=self.rescale_factor,
            mean=self.mean,
            std=self.std,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            temporal_patch_size=self.temporal_patch_size,
        )

    def placeholder(self, image: ProcessedImage) -> str:
        """The start marker, one pad token per placeholder token, the end marker."""
        return self.start_text + self.pad_text * image.num_tokens + self.end_text
