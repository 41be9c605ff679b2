"""Test kit for families that read images: generated pictures as a request carries them, prompts rendered the
server's way, and the engine checks every such family passes (chunked prefill encodes each image once, batched
equals solo, prefix-cache keys follow the processed pixels)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dgpp.media.prompt import ImageInput, ProcessedImage, PromptMedia
from dgpp.offline import greedy_generate
from dgpp.testing import conformance as conf

if TYPE_CHECKING:
    from PIL.Image import Image

    from dgpp.step.model import Model

_MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


def picture(width: int, height: int, mode: str, fmt: str, seed: int = 0) -> Image:
    """A Pillow image of smooth gradients plus noise in ``mode`` (RGB, RGBA, L, LA, or P with colour 3
    transparent), saved as ``fmt`` and read back, so the codec is on the path."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed + width * 7 + height)
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    rgb = np.clip(rgb + rng.integers(-40, 40, rgb.shape), 0, 255).astype(np.uint8)
    image = PILImage.fromarray(rgb, "RGB")
    if mode in ("RGBA", "LA"):
        alpha = PILImage.fromarray(rng.integers(0, 256, (height, width)).astype(np.uint8), "L")
        image = image.convert(mode[:-1])
        image.putalpha(alpha)
    elif mode == "P":
        image = image.convert("P", palette=PILImage.Palette.ADAPTIVE, colors=16)
    else:
        image = image.convert(mode)
    buffer = io.BytesIO()
    save = {"transparency": 3} if mode == "P" else {}
    image.save(buffer, format=fmt, **save)
    return PILImage.open(io.BytesIO(buffer.getvalue()))


def data_uri(image: Image, fmt: str = "PNG") -> str:
    """``image`` saved as ``fmt`` (PNG, JPEG or WEBP) in a base64 ``data:`` URI, as a request's image part."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:{_MEDIA_TYPES[fmt]};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_input_of(
    ckpt: Path, from_checkpoint: Callable[[Mapping[str, Any], Path], ImageInput]
) -> ImageInput:
    """The checkpoint's image input built from its ``config.json``, as the server builds it."""
    return from_checkpoint(json.loads((ckpt / "config.json").read_text()), ckpt)


def check_pixels_equal_the_processor(image_input: ImageInput, processor: Any, image: Image) -> ProcessedImage:
    """``image_input.process(image)`` has the grid and, bit for bit, the fp32 pixel rows of the reference
    ``processor`` (a transformers image processor); returns ours."""
    ours = image_input.process(image)
    theirs = processor(images=[image], return_tensors="pt")
    assert ours.grid == tuple(theirs["image_grid_thw"][0].tolist())
    assert ours.pixels.dtype == theirs["pixel_values"].dtype == torch.float32
    assert torch.equal(ours.pixels, theirs["pixel_values"])
    return ours


def reference_inputs(processed: list[ProcessedImage]) -> dict[str, torch.Tensor]:
    """The processed images as a transformers vision model takes them: ``pixel_values`` and ``image_grid_thw``."""
    return {
        "pixel_values": torch.cat([im.pixels for im in processed]),
        "image_grid_thw": torch.tensor([im.grid for im in processed]),
    }


def tower_outputs(
    tower: Any, reference_tower: Any, processed: list[ProcessedImage]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ``tower.encode`` of ``processed`` (one row per placeholder token of each image, checked) and the
    transformers ``reference_tower``'s pooled output for the same pixels, both ``[tokens, out_hidden]``."""
    ours = tower.encode(processed)
    assert [o.shape[0] for o in ours] == [im.num_tokens for im in processed]
    inputs = reference_inputs(processed)
    theirs = reference_tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    return torch.cat(ours), theirs


def rendered_prompt(
    ckpt: Path,
    msgs: list[dict[str, Any]],
    image_input: Callable[[Mapping[str, Any], Path], ImageInput],
    images: Mapping[str, Any],
    chat_template_kwargs: Mapping[str, Any],
) -> tuple[list[int], PromptMedia]:
    """``msgs`` rendered the server's way (placeholders, template, tokens) with the ``engine.images`` settings
    ``images``: the prompt ids and their ``PromptMedia``."""
    from dgpp.config_schema import ImagesConfig
    from dgpp.serve.images import ImageInputs
    from dgpp.text.chat_template import ChatTemplate
    from dgpp.text.tokenizer import Tokenizer

    inputs = ImageInputs.of(image_input_of(ckpt, image_input), ImagesConfig(**images))
    tok = Tokenizer.from_dir(ckpt)
    rendered, processed = inputs.prepare(msgs)
    template = ChatTemplate.for_checkpoint(tok)
    ids = tok.encode(template.render(rendered, chat_template_kwargs=dict(chat_template_kwargs)))
    return ids, inputs.media(ids, processed)


def runner_answer(
    ckpt: Path,
    msgs: list[dict[str, Any]],
    image_input: Callable[[Mapping[str, Any], Path], ImageInput],
    images: Mapping[str, Any],
    chat_template_kwargs: Mapping[str, Any],
    max_tokens: int,
) -> str:
    """The runner's greedy continuation (``max_tokens``, past EOS) of ``msgs`` rendered the server's way, decoded
    without special tokens: what a served chat with the same messages must answer."""
    from dgpp.startup.loading import load_model
    from dgpp.text.tokenizer import Tokenizer

    ids, media = rendered_prompt(ckpt, msgs, image_input, images, chat_template_kwargs)
    out = greedy_generate(load_model(ckpt), [ids], max_tokens, media=[media], stop_at_eos=False)[0]
    return Tokenizer.from_dir(ckpt).decode(out, skip_special_tokens=True)


PromptWithImages = tuple[list[int], list[ProcessedImage]]


def check_chunked_prefill_encodes_each_image_once(
    model: Model, tower: Any, images: ImageInput, prompts: list[PromptWithImages]
) -> None:
    """Chunked prefill (1, 5 and 16 tokens, cutting through placeholders) gives the one-shot greedy tokens, calls
    ``tower.encode`` once per image in all, and drops the kept embeddings once they are written."""
    calls: list[int] = []
    encode = tower.encode
    tower.encode = lambda ims: calls.append(len(ims)) or encode(ims)
    try:
        for prompt, pictures in prompts:
            one_shot = greedy_generate(model, [prompt], 12, media=[images.prompt_media(prompt, pictures)])
            for chunk in (1, 5, 16):
                calls.clear()
                media = images.prompt_media(prompt, pictures)
                chunked = greedy_generate(model, [prompt], 12, chunk_size=chunk, media=[media])
                assert chunked == one_shot, f"chunk {chunk}"
                assert sum(calls) == len(pictures), f"chunk {chunk}: encoder calls {calls}"
                assert all(im.embeddings is None for im in media.images)  # dropped once written
    finally:
        del tower.encode


def check_batched_with_images_equals_solo(
    model: Model, images: ImageInput, first: PromptWithImages, second: PromptWithImages
) -> None:
    """Two prompts with images batched around a text prompt give their solo greedy tokens, in one-shot and in
    7-token chunks."""
    (p1, i1), (p2, i2) = first, second
    text = conf.make_prompts(model.info.vocab_size, (30,), seed=3)[0]
    prompts = [p1, text, p2]

    def media() -> list[PromptMedia | None]:
        return [images.prompt_media(p1, i1), None, images.prompt_media(p2, i2)]

    together = greedy_generate(model, prompts, 10, media=media())
    solo = [greedy_generate(model, [p], 10, media=[m])[0] for p, m in zip(prompts, media(), strict=True)]
    assert together == solo
    assert greedy_generate(model, prompts, 10, chunk_size=7, media=media()) == solo


def check_prefix_keys_follow_the_processed_pixels(
    images: ImageInput, prompt: list[int], picture_args: tuple[Any, ...]
) -> None:
    """The prefix cache's block keys of ``prompt`` (one image placeholder) with ``picture(*picture_args)``: the same
    picture decoded again keys the same blocks; another one (seed 77) shares only the blocks before the image."""
    from dgpp.sched.block_pool import BlockPool
    from dgpp.sched.prefix_cache import PrefixCache

    pictures = [images.process(picture(*picture_args))]
    other = [images.process(picture(*picture_args, seed=77))]
    cache = PrefixCache(BlockPool(64, 4), 4)
    same = cache.block_keys(images.prompt_media(prompt, pictures).key_tokens(prompt))
    again = cache.block_keys(
        images.prompt_media(prompt, [images.process(picture(*picture_args))]).key_tokens(prompt)
    )
    changed = cache.block_keys(images.prompt_media(prompt, other).key_tokens(prompt))
    image_block = images.prompt_media(prompt, pictures).images[0].start // 4
    assert same == again  # the same picture decoded again keys the same prefix
    assert changed[:image_block] == same[:image_block]  # the text before the image is shared
    assert all(a != b for a, b in zip(changed[image_block:], same[image_block:], strict=True))
    assert torch.equal(pictures[0].pixels, images.process(picture(*picture_args)).pixels)
