"""Shared pieces of the ``check_*_cuda.py`` scripts: references are prepared on a CPU host, then checked on a GPU
machine (which has no transformers release new enough), with a markdown table of what held."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def reference_data(reference: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> dict:
    """What ``check`` compares against: the prompts, the reference's logits of every row, its greedy tokens."""
    from dgpp.testing import conformance as conf

    return {
        "prompts": prompts,
        "logits": [conf.reference_logits(reference, p) for p in prompts],
        "greedy": [conf.reference_greedy(reference, p, new_tokens) for p in prompts],
    }


@dataclass(frozen=True)
class GreedyAgreement:
    """One model's greedy decoding: the tokens of all prompts in one batch, and whether chunked prefill (13) and
    each prompt alone gave the same, and how many prompts equal the reference's tokens."""

    tokens: list[list[int]]
    chunked_same: bool
    alone_same: bool
    same_as_reference: int


def greedy_agreement(
    model, prompts: list[list[int]], new_tokens: int, reference: list[list[int]]
) -> GreedyAgreement:
    from dgpp.offline import greedy_generate

    one_shot = greedy_generate(model, prompts, new_tokens)
    chunked = greedy_generate(model, prompts, new_tokens, chunk_size=13)
    alone = [greedy_generate(model, [p], new_tokens)[0] for p in prompts]
    same = sum(a == b for a, b in zip(one_shot, reference, strict=True))
    return GreedyAgreement(one_shot, chunked == one_shot, alone == one_shot, same)


def print_table(header: list[str], rows: list[str]) -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    print("\n".join(rows))


def main(doc: str, prepare: Callable[[Path], None], check: Callable[[Path], int], default_dir: str) -> int:
    """``prepare --dir D`` (CPU host) or ``check --dir D`` (GPU); returns the exit status."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("mode", choices=("prepare", "check"))
    parser.add_argument("--dir", type=Path, default=Path(default_dir))
    args = parser.parse_args()
    if args.mode == "prepare":
        prepare(args.dir)
        return 0
    return check(args.dir)
