"""Request images -> decoded pictures: ``image_url`` parts carrying PNG, JPEG or WebP as base64 ``data:`` URIs.

Remote URLs are refused (the server fetches nothing). Every refusal is an ``ImageError`` whose message names what
was wrong; the server turns it into a 400 ``invalid_image`` naming the part. Limits (``engine.images``): the
decoded file's bytes and the picture's width x height, checked from the header before the pixels are decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dgpp.media.prompt import ImageError

if TYPE_CHECKING:
    from PIL.Image import Image

FORMATS = ("PNG", "JPEG", "WEBP")  # what Pillow calls the accepted formats
MIME_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


@dataclass(frozen=True)
class ImageLimits:
    max_images: int
    max_image_bytes: int
    max_image_pixels: int


def image_url_of(part: dict) -> str:
    """The URL string of an ``image_url`` part (OpenAI's ``{"url": ...}`` object, or a bare string)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string (a data: URI)")
    return url


def data_uri_bytes(url: str, limits: ImageLimits) -> bytes:
    """The file a ``data:image/...;base64,`` URI carries; remote URLs and other media types are refused."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise ImageError(
            f"only data: URIs are accepted (this server fetches no remote URL; got a {scheme!r} URL)"
        )
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError("a data: URI needs a ',' before its payload")
    media_type, *params = header.split(";")
    if media_type.lower() not in MIME_TYPES:
        raise ImageError(f"media type {media_type!r} is not one of image/png, image/jpeg, image/webp")
    if "base64" not in (p.lower() for p in params):
        raise ImageError("the data: URI must be base64-encoded (';base64,')")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:  # refused before decoding the base64
        raise ImageError(f"the image exceeds engine.images.max_image_bytes = {limits.max_image_bytes}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the data: URI's base64 payload is not valid ({e})") from None
    if len(data) > limits.max_image_bytes:
        raise ImageError(
            f"the image is {len(data)} bytes, over engine.images.max_image_bytes = {limits.max_image_bytes}"
        )
    return data


def decode_image(data: bytes, limits: ImageLimits) -> Image:
    """A fully decoded Pillow image of ``data`` (PNG, JPEG or WebP; the first frame of an animation)."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except UnidentifiedImageError:
        raise ImageError("the data is not a PNG, JPEG or WebP image") from None
    except Image.DecompressionBombError:  # Pillow's own bound, far above any useful picture
        raise ImageError(
            f"the image has more pixels than engine.images.max_image_pixels = {limits.max_image_pixels}"
        ) from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width}x{height} pixels")
    if width * height > limits.max_image_pixels:
        raise ImageError(
            f"the image is {width}x{height} = {width * height} pixels, over "
            f"engine.images.max_image_pixels = {limits.max_image_pixels}"
        )
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as e:  # Pillow's errors for a truncated or corrupt file
        raise ImageError(f"the {image.format} image cannot be decoded ({e})") from None
    return image


def load_request_image(part: dict, limits: ImageLimits) -> Image:
    """An ``image_url`` part -> the decoded picture (``ImageError`` says why not)."""
    return decode_image(data_uri_bytes(image_url_of(part), limits), limits)
