"""glm5_next prompts with images under tensor parallelism (2 ranks, gloo on CPU): the vision tower is replicated,
the text model split as for text; every rank's greedy tokens equal the single-rank model's, prefilled in chunks
that cut the image placeholders, batched with a text prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dgpp.family import World
from dgpp.startup.loading import load_model
from dgpp.testing.generate import greedy_generate
from dgpp.testing.tp_ranks import run_on_ranks
from dgpp_glm.glm5_next_images import Glm5NextImageInput
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next_vl

pytest.importorskip("PIL.Image")
from test_glm5_next_vision import PICTURES, image_prompt, picture  # noqa: E402

WORLD = 2


def _run(path: str, world: World) -> list[list[int]]:
    ckpt = Path(path)
    images = Glm5NextImageInput.from_checkpoint(json.loads((ckpt / "config.json").read_text()), ckpt)
    pictures = [images.process(picture(*PICTURES[0])), images.process(picture(*PICTURES[4]))]
    ids = image_prompt(ckpt, images, pictures, [[97, 72, 105], [32], [63, 98]])
    model = load_model(path, world=world)
    media = [images.prompt_media(ids, pictures), None]
    return greedy_generate(model, [ids, ids[:9]], 10, chunk_size=7, media=media)


def test_tp2_with_images_matches_single_rank(tmp_path):
    path = build_tiny_glm5_next_vl(tmp_path / "ckpt", seed=33)
    single = _run(str(path), World())
    for rank, got in enumerate(run_on_ranks(_run, path, tmp_path, WORLD)):
        assert got == single, f"rank {rank}"
