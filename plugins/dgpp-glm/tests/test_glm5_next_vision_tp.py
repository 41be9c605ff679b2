"""glm5_next prompts with images under tensor parallelism (2 ranks, gloo on CPU): the vision tower is replicated,
the text model split as for text; every rank's greedy tokens equal the single-rank model's, prefilled in chunks
that cut the image placeholders, batched with a text prompt. The admission journal carries a prompt's images and
its one axis of positions to the peers bit for bit (``dgpp.media.wire``)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from dgpp.dist.records import Admission
from dgpp.family import World
from dgpp.media.wire import media_from_wire, media_to_wire
from dgpp.offline import greedy_generate
from dgpp.startup.loading import load_model
from dgpp.testing.images import image_input_of, picture
from dgpp.testing.tp_ranks import run_on_ranks
from dgpp_glm.glm5_next_images import Glm5NextImageInput
from dgpp_glm.testing_glm5_next import build_tiny_glm5_next_vl

pytest.importorskip("PIL.Image")
from test_glm5_next_vision import PICTURES, image_prompt  # noqa: E402

WORLD = 2


def _prompt(ckpt: Path):
    images = image_input_of(ckpt, Glm5NextImageInput.from_checkpoint)
    pictures = [images.process(picture(*PICTURES[0])), images.process(picture(*PICTURES[4]))]
    ids = image_prompt(ckpt, images, pictures, [[97, 72, 105], [32], [63, 98]])
    return ids, images.prompt_media(ids, pictures)


def _run(path: str, world: World) -> list[list[int]]:
    ids, media = _prompt(Path(path))
    model = load_model(path, world=world)
    return greedy_generate(model, [ids, ids[:9]], 10, chunk_size=7, media=[media, None])


def test_tp2_with_images_matches_single_rank(tmp_path):
    path = build_tiny_glm5_next_vl(tmp_path / "ckpt", seed=33)
    single = _run(str(path), World())
    for rank, got in enumerate(run_on_ranks(_run, path, tmp_path, WORLD)):
        assert got == single, f"rank {rank}"


def test_journal_carries_the_images_bit_for_bit(tmp_path):
    ids, media = _prompt(build_tiny_glm5_next_vl(tmp_path / "ckpt", seed=34))
    admission = Admission(id="r/0", choice=0, p=ids, sp={}, gs=1, m=media_to_wire(media))
    peer = media_from_wire(msgspec.json.decode(msgspec.json.encode(admission), type=Admission).m)
    assert peer is not None and peer.rope_delta == media.rope_delta == 0
    assert torch.equal(peer.rope_positions, media.rope_positions)
    assert peer.rope_positions.shape == (1, len(ids))  # no RoPE: one axis of token indices
    for ours, theirs in zip(peer.images, media.images, strict=True):
        assert torch.equal(ours.processed.pixels, theirs.processed.pixels)
        assert (ours.start, ours.length, ours.digest) == (theirs.start, theirs.length, theirs.digest)
    assert peer.key_tokens(ids) == media.key_tokens(ids)
