"""Conformance checks a family plugin's tests call on tiny checkpoints (see ``builders.py``).

Each check raises ``AssertionError`` with a message that says what diverged and where:
- ``check_logits``: every prompt row's logits, all prompts (of different lengths) in ONE engine step,
  vs the transformers model run on each prompt alone, within ``rtol`` of the reference's max |logit|;
- ``check_greedy``: greedy tokens identical to transformers' ``generate(do_sample=False)``;
- ``check_greedy_near_ties``: (low precision) teacher-forced along transformers' greedy path, every pick
  equal except at a near-tie within ``rtol``;
- ``check_chunked_prefill``: greedy tokens with several prefill chunk sizes identical to one-shot;
- ``check_mixed_batch``: a batch mixing prefill and decode rows identical to each sequence alone;
- ``check_batch_invariance``: each prompt's logits bit-identical alone and batched;
- ``check_chunk_invariance``: each row's logits bit-identical with and without chunked prefill;
- ``check_state_snapshot``: (hybrid models) snapshot a sequence's state mid-way, continue, restore,
  continue again: the two continuations are identical;
- ``check_prefix_hit``: a second sequence that shares a cold run's first blocks (and its state snapshot at the
  cut), as a prefix-cache hit does, continues exactly as the cold run.
"""

from __future__ import annotations

import torch

from dgpp.engine.runner import ModelRunner
from dgpp.engine.work import SeqWork
from dgpp.offline import DEFAULT_LENGTHS as DEFAULT_LENGTHS  # the kit's names for what dgpp.offline runs
from dgpp.offline import engine_all_logits as engine_all_logits
from dgpp.offline import greedy_generate, make_pools
from dgpp.offline import make_prompts as make_prompts
from dgpp.step.model import Model


@torch.inference_mode()
def reference_logits(reference: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return reference(torch.tensor([prompt])).logits[0].float()


def check_logits(
    model: Model,
    reference: torch.nn.Module,
    prompts: list[list[int]],
    rtol: float = 1e-4,
    max_outlier_rows: float = 0.0,
) -> float:
    """Returns the worst per-row relative error (max |diff| / max |reference logit| of the prompt).

    ``max_outlier_rows``: the fraction of rows allowed above ``rtol``. Keep it 0 for fp32. In bf16 a
    MoE router at a near-tie can pick a different expert than the reference for a row (either side's
    rounding decides), which moves that whole row; such flips are isolated rows, so a small
    fraction is allowed there while every other row must still be within ``rtol``.
    """
    errors: list[float] = []
    for i, (ours, prompt) in enumerate(zip(engine_all_logits(model, prompts), prompts, strict=True)):
        ref = reference_logits(reference, prompt).to(ours.device)  # the reference may run on another device
        rows = ((ours - ref).abs().max(-1).values / ref.abs().max()).tolist()
        errors.extend(rows)
        if max_outlier_rows == 0.0 and max(rows) > rtol:
            raise AssertionError(
                f"prompt {i} (length {len(prompt)}): logits differ by {max(rows):.3g} relative (> {rtol})"
            )
    outliers = sum(e > rtol for e in errors)
    assert outliers <= max_outlier_rows * len(errors), (
        f"{outliers} of {len(errors)} logit rows differ by more than {rtol} relative (worst {max(errors):.3g}); "
        f"at most {max_outlier_rows:.0%} allowed"
    )
    return max(errors)


@torch.inference_mode()
def reference_greedy(reference: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), min(len(a), len(b)))


def assert_same_tokens(ours: list[int], theirs: list[int], what: str) -> None:
    if ours != theirs:
        at = _first_diff(ours, theirs)
        raise AssertionError(
            f"{what}: tokens differ from position {at}: {ours[at : at + 8]} vs {theirs[at : at + 8]}"
        )


def check_greedy(
    model: Model, reference: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 32
) -> None:
    ours = greedy_generate(model, prompts, max_new_tokens)
    for i, prompt in enumerate(prompts):
        assert_same_tokens(
            ours[i], reference_greedy(reference, prompt, max_new_tokens), f"prompt {i} greedy vs transformers"
        )


@torch.inference_mode()
def engine_forced_logits(
    model: Model, prompt: list[int], forced: list[int], block_size: int = 16
) -> torch.Tensor:
    """Our logits for each step of a teacher-forced decode: prefill ``prompt``, then feed ``forced``
    one token at a time; row ``i`` is the distribution that picks ``forced[i]``."""
    pools, blocks, slots = make_pools(model, [len(prompt) + len(forced)], block_size)
    runner = ModelRunner(model, pools)
    table, slot = blocks.allocate(blocks.blocks_for_tokens(len(prompt) + len(forced))), slots.allocate()
    rows = [runner.step([SeqWork(slot, table, 0, list(prompt))])[0]]
    for i, token in enumerate(forced[:-1]):
        rows.append(runner.step([SeqWork(slot, table, len(prompt) + i, [token])])[0])
    return torch.stack(rows)


@torch.inference_mode()
def check_greedy_near_ties(
    model: Model, reference: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, rtol: float
) -> int:
    """Greedy along the reference's own path (teacher-forced through our decode path): every step's
    pick must equal the reference's, except where the reference itself scores our pick within
    ``rtol`` (of its max |logit|) of its own — a near-tie that rounding in a low-precision dtype may
    decide either way. Returns the number of such near-tie steps (the caller bounds it)."""
    ties = 0
    for i, prompt in enumerate(prompts):
        gen = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        path = gen.sequences[0, len(prompt) :].tolist()
        ref_rows = torch.cat(gen.logits).float()
        ours = engine_forced_logits(model, prompt, path).argmax(-1).tolist()
        for step, (mine, theirs) in enumerate(zip(ours, path, strict=True)):
            if mine == theirs:
                continue
            row = ref_rows[step]
            gap = float(row[theirs] - row[mine]) / float(row.abs().max())
            assert gap <= rtol, (
                f"prompt {i} step {step}: picked {mine}, reference {theirs}, not a near-tie (gap {gap:.3g})"
            )
            ties += 1
    return ties


def check_batch_invariance(model: Model, prompts: list[list[int]], kv_dtype: str = "auto") -> None:
    """Each prompt's logits rows are bit-identical alone and in one step with all the others
    (row-independent arithmetic: a batch can never flip a greedy near-tie)."""
    together = engine_all_logits(model, prompts, kv_dtype=kv_dtype)
    for i, prompt in enumerate(prompts):
        alone = engine_all_logits(model, [prompt], kv_dtype=kv_dtype)[0]
        if not torch.equal(together[i], alone):
            worst = float((together[i] - alone).abs().max())
            raise AssertionError(f"prompt {i}: logits in a batch differ from alone by up to {worst:.3g}")


def check_chunk_invariance(
    model: Model,
    prompts: list[list[int]],
    chunk_sizes: tuple[int, ...] = (1, 5),
    rtol: float = 0.0,
    kv_dtype: str = "auto",
) -> None:
    """Every row's logits bit-identical whether the prompts are prefilled in one step or in chunks; with ``rtol``,
    within ``rtol`` of the prompt's largest logit instead (a recurrent layer's chunked form sums in another order
    than its token-by-token step). ``kv_dtype``: the K/V format (``engine.kv_dtype``)."""
    one_shot = engine_all_logits(model, prompts, kv_dtype=kv_dtype)
    for size in chunk_sizes:
        for i, (chunked, whole) in enumerate(
            zip(engine_all_logits(model, prompts, chunk_size=size, kv_dtype=kv_dtype), one_shot, strict=True)
        ):
            worst = float((chunked - whole).abs().max())
            if (worst > rtol * float(whole.abs().max())) if rtol else not torch.equal(chunked, whole):
                raise AssertionError(
                    f"prompt {i}: logits with prefill chunk {size} differ from one-shot by up to {worst:.3g}"
                )


def check_chunked_prefill(
    model: Model,
    prompts: list[list[int]],
    chunk_sizes: tuple[int, ...] = (1, 4, 7),
    max_new_tokens: int = 8,
    kv_dtype: str = "auto",
) -> None:
    one_shot = greedy_generate(model, prompts, max_new_tokens, kv_dtype=kv_dtype)
    for size in chunk_sizes:
        chunked = greedy_generate(model, prompts, max_new_tokens, chunk_size=size, kv_dtype=kv_dtype)
        for i in range(len(prompts)):
            assert_same_tokens(chunked[i], one_shot[i], f"prompt {i} with prefill chunk {size} vs one-shot")


def check_mixed_batch(
    model: Model,
    prompts: list[list[int]],
    max_new_tokens: int = 8,
    chunk_size: int | None = 5,
    kv_dtype: str = "auto",
) -> None:
    """Prompts of different lengths, chunked, run together (so steps mix prefill and decode rows)."""
    together = greedy_generate(model, prompts, max_new_tokens, chunk_size=chunk_size, kv_dtype=kv_dtype)
    for i, prompt in enumerate(prompts):
        alone = greedy_generate(model, [prompt], max_new_tokens, kv_dtype=kv_dtype)
        assert_same_tokens(together[i], alone[0], f"prompt {i} in a mixed batch vs alone")


@torch.inference_mode()
def check_state_snapshot(
    model: Model,
    prompt: list[int],
    split: int,
    max_new_tokens: int = 8,
    block_size: int = 16,
    kv_dtype: str = "auto",
) -> None:
    """Prefill ``prompt[:split]``, snapshot the state slot, continue; restore the snapshot and continue
    again over the same blocks: both continuations must be identical."""
    total = len(prompt) + max_new_tokens
    pools, blocks, slots = make_pools(model, [total, total], block_size, kv_dtype)
    runner = ModelRunner(model, pools)
    table = blocks.allocate(blocks.blocks_for_tokens(total))
    live, snapshot = slots.allocate(), slots.allocate()
    runner.step([SeqWork(live, table, 0, prompt[:split], want_logits=False)])
    pools.copy_state(live, snapshot)

    def continue_from_split() -> list[int]:
        tokens = list(prompt)
        logits = runner.step([SeqWork(live, table, split, tokens[split:])])
        out = []
        for _ in range(max_new_tokens):
            out.append(int(torch.argmax(logits[0])))
            tokens.append(out[-1])
            logits = runner.step([SeqWork(live, table, len(tokens) - 1, [tokens[-1]])])
        return out

    first = continue_from_split()
    pools.copy_state(snapshot, live)
    assert_same_tokens(continue_from_split(), first, "continuation after restoring the state snapshot")


def _continue(
    runner: ModelRunner, slot: int, table: list[int], prompt: list[int], start: int, new: int
) -> list[int]:
    """Prefill ``prompt[start:]`` after ``start`` cached tokens, then ``new`` greedy tokens."""
    tokens = list(prompt)
    logits = runner.step([SeqWork(slot, table, start, tokens[start:])])
    out = []
    for _ in range(new):
        out.append(int(torch.argmax(logits[0])))
        tokens.append(out[-1])
        logits = runner.step([SeqWork(slot, table, len(tokens) - 1, [tokens[-1]])])
    return out


@torch.inference_mode()
def check_prefix_hit(
    model: Model,
    prompt: list[int],
    shared_blocks: int,
    max_new_tokens: int = 8,
    block_size: int = 16,
    kv_dtype: str = "auto",
) -> None:
    """A cold run prefills ``prompt`` in two steps cut after ``shared_blocks`` blocks, snapshotting its state at
    the cut; a second sequence whose table starts with those same blocks (the prefix cache's hit) restores the
    snapshot, prefills only the rest and must continue identically."""
    split = shared_blocks * block_size
    if not 0 < split < len(prompt):
        raise ValueError(
            f"{shared_blocks} shared blocks of {block_size} do not cut a {len(prompt)}-token prompt"
        )
    total = len(prompt) + max_new_tokens
    pools, blocks, slots = make_pools(model, [total, total], block_size, kv_dtype)
    runner = ModelRunner(model, pools)
    cold_table = blocks.allocate(blocks.blocks_for_tokens(total))
    cold, hit = slots.allocate(), slots.allocate()
    runner.step([SeqWork(cold, cold_table, 0, prompt[:split], want_logits=False)])
    pools.copy_state(cold, hit)
    first = _continue(runner, cold, cold_table, prompt, split, max_new_tokens)
    hit_table = cold_table[:shared_blocks] + blocks.allocate(blocks.blocks_for_tokens(total) - shared_blocks)
    again = _continue(runner, hit, hit_table, prompt, split, max_new_tokens)
    assert_same_tokens(again, first, f"continuation after a {shared_blocks}-block prefix hit vs cold")
