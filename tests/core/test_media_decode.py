"""Request images: data: URIs decoded to Pillow pictures under ``engine.images`` limits, every refusal an
``ImageError`` saying why (the server turns it into a 400 ``invalid_image`` naming the part); placeholder text
joins its message's text without separators."""

from __future__ import annotations

import base64
import io

import pytest

from dgpp.media.decode import ImageLimits, load_request_image
from dgpp.media.prompt import ImageError
from dgpp.text.chat_template import IMAGE_TEXT, prepare_messages

PIL = pytest.importorskip("PIL.Image")
LIMITS = ImageLimits(max_images=4, max_image_bytes=4096, max_image_pixels=64 * 64)


def encoded(image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def part(data: bytes, mime: str = "image/png") -> dict:
    return {
        "type": "image_url",
        "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"},
    }


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_each_accepted_format_decodes(fmt, mime):
    picture = PIL.new("RGB", (20, 10), (200, 30, 60))
    decoded = load_request_image(part(encoded(picture, fmt), mime), LIMITS)
    assert decoded.size == (20, 10) and decoded.format == fmt


@pytest.mark.parametrize(
    "image_url,why",
    [
        ({"url": "https://example.com/a.png"}, "remote URL"),
        ({"url": ""}, "non-empty string"),
        ({}, "non-empty string"),
        ({"url": "data:image/png;base64"}, "','"),
        ({"url": "data:image/png,AAAA"}, "base64-encoded"),
        ({"url": "data:image/bmp;base64,AAAA"}, "media type"),
        ({"url": "data:image/png;base64,!!!!"}, "not valid"),
        (
            {"url": "data:image/png;base64," + base64.b64encode(b"GIF89a....").decode()},
            "not a PNG, JPEG or WebP",
        ),
    ],
)
def test_refusals_say_why(image_url, why):
    with pytest.raises(ImageError, match=why):
        load_request_image({"type": "image_url", "image_url": image_url}, LIMITS)


def test_a_gif_body_under_a_png_media_type_is_refused():
    gif = encoded(PIL.new("RGB", (4, 4)), "GIF")
    with pytest.raises(ImageError, match="not a PNG, JPEG or WebP"):
        load_request_image(part(gif), LIMITS)


def test_limits_on_bytes_and_pixels():
    noise = PIL.effect_noise((60, 60), 100).convert("RGB")
    with pytest.raises(ImageError, match="max_image_bytes"):
        load_request_image(part(encoded(noise, "PNG")), LIMITS)
    wide = PIL.new("L", (200, 30))  # compresses to a few bytes, but 6000 pixels
    with pytest.raises(ImageError, match="max_image_pixels"):
        load_request_image(part(encoded(wide, "PNG")), LIMITS)


def test_a_truncated_file_is_refused():
    data = encoded(PIL.effect_noise((40, 40), 100).convert("RGB"), "PNG")
    with pytest.raises(ImageError, match="cannot be decoded"):
        load_request_image(part(data[: len(data) // 2]), ImageLimits(4, 1 << 20, 1 << 20))


def test_placeholders_touch_their_text_and_texts_keep_newlines():
    parts = [
        {"type": "text", "text": "first"},
        {"type": "text", "text": "second"},
        {"type": IMAGE_TEXT, "text": "<I>"},
        {"type": "text", "text": "third"},
    ]
    assert prepare_messages([{"role": "user", "content": parts}])[0]["content"] == "first\nsecond<I>third"
