"""``image_url`` parts of a chat request: counted and refused by position, decoded and processed by the family's
``ImageInput`` off the event loop, and replaced by the family's placeholder text before the template renders.

Every refusal is an OpenAI-shaped 400 naming the part (``messages[i].content[j]``): ``invalid_image`` for a picture
that cannot be used (not a PNG/JPEG/WebP data: URI, a remote URL, over a size limit, corrupt) and for more images
than ``engine.images.max_images``; a model without a vision encoder refuses the part naming the model
(``dgpp.serve.validate.refuse_image_parts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dgpp.config_schema import ImagesConfig
from dgpp.media.decode import ImageLimits, load_request_image
from dgpp.media.prompt import ImageError, ImageInput, ProcessedImage, PromptMedia
from dgpp.serve.errors import APIError, invalid
from dgpp.serve.validate import image_parts
from dgpp.text.chat_template import IMAGE_TEXT


def _bad_image(where: str, why: str) -> APIError:
    return invalid(f"{where}: {why}", where, "invalid_image")


@dataclass(frozen=True)
class ImageInputs:
    """The served model's image preprocessing (its family's ``ImageInput``) under ``engine.images`` limits."""

    family: ImageInput
    limits: ImageLimits

    @classmethod
    def of(cls, family: ImageInput, cfg: ImagesConfig) -> ImageInputs:
        return cls(family, ImageLimits(cfg.max_images, cfg.max_image_bytes, cfg.max_image_pixels))

    def check_count(self, messages: list[Any]) -> None:
        """400 naming the first part past ``max_images`` (checked before anything is decoded)."""
        parts = image_parts(messages)
        if len(parts) > self.limits.max_images:
            i, j, _ = parts[self.limits.max_images]
            raise _bad_image(
                f"messages[{i}].content[{j}]",
                f"the request holds {len(parts)} images, over engine.images.max_images = {self.limits.max_images}",
            )

    def prepare(self, messages: list[Any]) -> tuple[list[Any], list[ProcessedImage]]:
        """Decode and process every image part (in order) and put the family's placeholder text in its place; a
        fresh message list, the request's is untouched."""
        parts = image_parts(messages)
        if not parts:
            return messages, []
        out = list(messages)
        processed: list[ProcessedImage] = []
        for i, j, part in parts:
            where = f"messages[{i}].content[{j}]"
            try:
                image = self.family.process(load_request_image(part, self.limits))
            except ImageError as e:
                raise _bad_image(where, str(e)) from None
            processed.append(image)
            if out[i] is messages[i]:
                out[i] = {**messages[i], "content": list(messages[i]["content"])}
            out[i]["content"][j] = {"type": IMAGE_TEXT, "text": self.family.placeholder(image)}
        return out, processed

    def media(self, prompt: list[int], images: list[ProcessedImage]) -> PromptMedia | None:
        """The prompt's ``PromptMedia`` (None without images); a placeholder mismatch is a 400 on ``messages``."""
        if not images:
            return None
        try:
            return self.family.prompt_media(prompt, images)
        except ImageError as e:
            raise _bad_image("messages", str(e)) from None
