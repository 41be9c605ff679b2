"""Image encoder time and time to first token for one 1024x1024 picture (not a CI test), for the two families that
read images: GLM-5.3-Flash (``glm5_next``) and Qwen3.8-Flash-Next (``qwen4_exp``).

Each vision tower is built whole at its release's vision geometry with random weights. GLM-5.3-Flash: 24 blocks of
1024 wide, 16 heads, MLP 4096, patch 14, merge 2, merger 10240 out to the text width 4096. Qwen3.8-Flash-Next:
27 blocks of 1152 wide, 16 heads, MLP 4304, patch 16, merge 2, a 48 x 48 learned position table, out to the
text width 2560. The text models are the layer-scaled bench geometries (the release's layer shapes, a few layers):
``glm-5.3-flash-6l`` and ``qwen3.8-flash-next-8l``.

The picture is random RGB noise saved as PNG and sent as a base64 ``data:`` URL, as a client sends it. Timed, each
the median of ``--repeats`` after one warm-up:

- host: the data URL decoded (``dgpp.media.decode``) and the family's processor (resize, normalise, patch rows);
- encoder: the tower's forward on the device (the pixel rows' copy to it included), synchronized; its TFLOP/s
  from the FLOPs torch counts for it (matrix products and attention), against the H200's dense bf16 peak
  (989 TFLOP/s);
- prefill: one runner step over the prompt's token ids (text, image markers, placeholders) with no image, so no
  encoder: the text model's share;
- TTFT: request to first token: decode, processor, prompt layout, one runner step with the image (the tower runs
  inside it, as in serving) and the greedy token read back to the host.

    source tests/perf/device_env.sh && python3 tests/perf/check_image_ttft.py
    python3 tests/perf/check_image_ttft.py --device cpu   # tiny towers and text model: a smoke run

Needs torch, numpy, Pillow, structlog, msgspec, pluggy. Exits non-zero when the image gives no placeholder tokens, the
tower does not run once per request or the first token is not a vocabulary id.
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from check_flint_cuda import finish

H200_BF16_PEAK_TFLOPS = 989.0
SIDE = 1024
# prompt text around the image: a short instruction before, a few tokens after
TEXT_BEFORE, TEXT_AFTER = 24, 8

GLM_VISION: dict[str, Any] = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 4096,
    "projection_intermediate_size": 10240,
}
QWEN_VISION: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 2560,
    "num_position_embeddings": 2304,
}
TINY_GLM_VISION: dict[str, Any] = {
    **GLM_VISION,
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "projection_intermediate_size": 64,
}
TINY_QWEN_VISION: dict[str, Any] = {
    **QWEN_VISION,
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
}


@dataclass
class Family:
    name: str
    geometry: str  # the text model's bench geometry
    vision: dict[str, Any]
    image_input: Any  # the family's ImageInput (PatchImageInput subclass)
    marker_ids: tuple[int, int]  # image start, image end


def png_data_url(side: int, seed: int = 0) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def families(tiny: bool) -> list[Family]:
    from dgpp_glm.glm5_next_images import Glm5NextImageInput
    from dgpp_qwen.qwen4_exp_images import Qwen4ExpImageInput

    common = {
        "merge_size": 2,
        "temporal_patch_size": 2,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "start_text": "",
        "pad_text": "",
        "end_text": "",
    }
    # release ids and processor budgets; the tiny text models' 512-token vocabularies take their top three ids
    glm_ids = (509, 510, 511) if tiny else (154830, 154854, 154831)
    glm = Glm5NextImageInput(
        **common,
        patch_size=14,
        patch_expand_factor=1,
        min_tokens=4 if tiny else 16,
        max_tokens=36 if tiny else 8000,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        image_token_id=glm_ids[1],
    )
    qwen_ids = (509, 510, 511) if tiny else (248053, 248056, 248054)
    qwen = Qwen4ExpImageInput(
        **common,
        patch_size=16,
        min_pixels=56 * 56 if not tiny else 32 * 32,
        max_pixels=28 * 28 * 1280 if not tiny else 64 * 64,
        mean=(0.48145466, 0.4578275, 0.40821073),
        std=(0.26862954, 0.26130258, 0.27577711),
        image_token_id=qwen_ids[1],
    )
    return [
        Family(
            "GLM-5.3-Flash",
            "tiny-glm-5.3-flash" if tiny else "glm-5.3-flash-6l",
            TINY_GLM_VISION if tiny else GLM_VISION,
            glm,
            (glm_ids[0], glm_ids[2]),
        ),
        Family(
            "Qwen3.8-Flash-Next",
            "tiny-qwen3.8-flash-next" if tiny else "qwen3.8-flash-next-8l",
            TINY_QWEN_VISION if tiny else QWEN_VISION,
            qwen,
            (qwen_ids[0], qwen_ids[2]),
        ),
    ]


def median_ms(fn: Callable[[], Any], repeats: int, device: str) -> float:
    """Median wall milliseconds of ``fn()`` after one warm-up call, the device synchronized around each."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tower_flops(tower: torch.nn.Module, images: list[Any]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        tower.encode(images)
    return int(counter.get_total_flops())


def build(fam: Family, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    """(tower, the whole model: text geometry and tower) with random weights on ``device``."""
    from dgpp.bench.models import hf_config, random_model_from_config

    raw = {**hf_config(fam.geometry, dtype), "vision_config": fam.vision}
    model = random_model_from_config(raw, device, seed=1)
    return model.visual, model


@torch.inference_mode()
def measure(fam: Family, device: str, dtype: torch.dtype, repeats: int, failures: list[str]) -> list[str]:
    from dgpp.bench.decode import DecodeSession, random_prompts
    from dgpp.engine.work import SeqWork
    from dgpp.media.decode import ImageLimits, load_request_image

    t0 = time.perf_counter()
    tower, model = build(fam, device, dtype)
    built_s = time.perf_counter() - t0
    part = {"type": "image_url", "image_url": {"url": png_data_url(SIDE)}}
    limits = ImageLimits(max_images=1, max_image_bytes=64 << 20, max_image_pixels=SIDE * SIDE)

    def host() -> Any:
        return fam.image_input.process(load_request_image(part, limits))

    processed = host()
    host_ms = median_ms(host, repeats, "cpu")
    encoder_ms = median_ms(lambda: tower.encode([processed]), repeats, device)
    flops = tower_flops(tower, [processed])
    tflops = flops / (encoder_ms * 1e-3) / 1e12
    n_img = processed.num_tokens
    out = [
        f"{fam.name}: built in {built_s:.1f} s; {SIDE}x{SIDE} PNG ({len(part['image_url']['url']) * 3 // 4 >> 10} KiB)"
        f" -> grid {tuple(processed.grid)} patches, {n_img} image tokens",
        f"{fam.name}: host decode + processor {host_ms:.1f} ms; encoder {encoder_ms:.2f} ms, "
        f"{flops / 1e9:.2f} GFLOP, {tflops:.2f} TFLOP/s ({100 * tflops / H200_BF16_PEAK_TFLOPS:.1f}% of the "
        f"H200's {H200_BF16_PEAK_TFLOPS:.0f} bf16 peak)",
    ]
    if n_img <= 0:
        failures.append(f"{fam.name}: no image tokens")
    vocab = model.info.vocab_size
    before, after = random_prompts(2, TEXT_BEFORE, min(vocab, 1000), seed=2)
    start, end = fam.marker_ids
    prompt = [*before, start, *[fam.image_input.image_token_id] * n_img, end, *after[:TEXT_AFTER]]
    session = DecodeSession(model, 1, len(prompt) + 1, 16, graph=False)
    table = session.tables[0]

    def prefill() -> int:
        return int(torch.argmax(session.runner.step([SeqWork(0, table, 0, prompt)]), dim=-1).item())

    def ttft() -> int:
        image = fam.image_input.process(load_request_image(part, limits))
        media = fam.image_input.prompt_media(prompt, [image])
        logits = session.runner.step([SeqWork(0, table, 0, prompt, media=media)])
        return int(torch.argmax(logits, dim=-1).item())

    prefill_ms = median_ms(prefill, repeats, device)
    encoded = []  # the tower runs inside the TTFT step, once per request
    hook = tower.register_forward_hook(lambda *_: encoded.append(1))
    ttft_ms = median_ms(ttft, repeats, device)
    first = ttft()
    hook.remove()
    if len(encoded) != repeats + 2:
        failures.append(f"{fam.name}: the tower ran {len(encoded)} times in {repeats + 2} requests")
    if not 0 <= first < vocab:
        failures.append(f"{fam.name}: first token {first} outside the vocabulary")
    return [
        *out,
        f"{fam.name} ({fam.geometry}): prompt {len(prompt)} tokens ({n_img} image); prefill without the image "
        f"{prefill_ms:.1f} ms; TTFT {ttft_ms:.1f} ms (first token {first})",
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", choices=("glm", "qwen"), help="one family")
    args = ap.parse_args()
    tiny = args.device == "cpu"
    dtype = torch.float32 if tiny else torch.bfloat16  # the tiny smoke geometries run in fp32
    if args.device == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    failures: list[str] = []
    table: list[str] = []
    for fam in families(tiny):
        if args.only and not fam.name.lower().startswith(args.only):
            continue
        lines = measure(fam, args.device, dtype, args.repeats, failures)
        print("\n".join(lines), flush=True)
        table += lines
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return finish(table, failures)


if __name__ == "__main__":
    sys.exit(main())
