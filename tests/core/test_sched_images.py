"""The scheduler with prompts that carry images, on the toy runner: an image prompt's prefill chunks are the only
work of their forwards while decode rows keep running every tick, outputs equal solo runs, and the prefix cache
hits for the same image and text but not past the placeholders of another image."""

from __future__ import annotations

import torch
from test_sched import BS, CHUNK, build, run, seq, tokens

from dgpp.media.prompt import ProcessedImage, PromptImage, PromptMedia
from dgpp.sched.request import Sequence

IMAGE_START, IMAGE_TOKENS = 5, 12


def with_image(s: Sequence, seed: int) -> Sequence:
    """``s`` with one image over prompt tokens 5..17 (random pixels: ``seed`` picks the picture)."""
    pixels = torch.randn(IMAGE_TOKENS * 4, 6, generator=torch.Generator().manual_seed(seed))
    image = ProcessedImage(pixels, (1, 6, 8), IMAGE_TOKENS)
    positions = torch.arange(s.prompt_len).expand(3, -1)
    s.media = PromptMedia([PromptImage(image, IMAGE_START, image.digest)], positions, 0)
    return s


def image_prompt() -> list[int]:
    return [1, 2, 3, 4, 5, *[40] * IMAGE_TOKENS, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def recorded(runner) -> list[list[bool]]:
    """Per runner step: which works carry a prompt with images."""
    steps: list[list[bool]] = []
    step = runner.step

    def record(works, *args, **kwargs):
        steps.append([w.media is not None for w in works])
        return step(works, *args, **kwargs)

    runner.step = record
    return steps


def test_image_prefill_runs_alone_and_decode_rows_keep_going() -> None:
    sched, runner = build(idle_chunks=4, busy_chunks=4)
    steps = recorded(runner)
    ev: dict = {}
    sched.submit([seq("text", list(range(1, 8)), ev, max_tokens=12, ignore_eos=True)])
    sched.tick()  # the text prompt prefills and starts decoding
    decoded = len(tokens(ev, ("text", 0)))
    sched.submit([with_image(seq("image", image_prompt(), ev, ignore_eos=True), seed=1)])
    sched.submit([seq("later", list(range(2, 12)), ev, ignore_eos=True)])  # would share a forward
    chunks = -(-len(image_prompt()) // CHUNK)
    for _ in range(chunks):
        sched.tick()
    assert len(tokens(ev, ("text", 0))) == decoded + chunks  # a decode row every tick of the image prefill
    run(sched)
    image_steps = [s for s in steps if any(s)]
    assert len(image_steps) >= chunks and all(len(s) == 1 for s in image_steps[:chunks])
    assert tokens(ev, ("later", 0))  # the text prompt behind it was served too


def test_outputs_equal_solo_and_prefix_hits_follow_the_image() -> None:
    def alone(seed: int) -> list[int]:
        sched, _ = build()
        ev: dict = {}
        sched.submit([with_image(seq("a", image_prompt(), ev, ignore_eos=True), seed)])
        run(sched)
        return tokens(ev, ("a", 0))

    sched, _ = build(max_concurrency=3)
    ev: dict = {}
    first = with_image(seq("first", image_prompt(), ev, ignore_eos=True), seed=1)
    sched.submit(
        [
            first,
        ]
    )
    sched.submit([seq("text", list(range(3, 20)), ev, ignore_eos=True)])
    run(sched)
    assert tokens(ev, ("first", 0)) == alone(1)
    again = with_image(seq("again", image_prompt(), ev, ignore_eos=True), seed=1)
    other = with_image(seq("other", image_prompt(), ev, ignore_eos=True), seed=2)
    sched.submit([again])
    run(sched)
    sched.submit([other])
    run(sched)
    assert again.cached_tokens >= IMAGE_START + IMAGE_TOKENS  # the same picture: its placeholders are cached
    assert other.cached_tokens <= IMAGE_START // BS * BS  # another picture: only the text before it
    assert tokens(ev, ("again", 0)) == alone(1) and tokens(ev, ("other", 0)) == alone(2)
