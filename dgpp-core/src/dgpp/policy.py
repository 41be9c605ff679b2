"""How this process computes: one frozen ``ExecPolicy``, built once at startup, read by layers and kernels.

The engine builds its policy from its ``engine.*`` keys (``ExecPolicy.for_engine``) and installs it before the
model loads; without an engine (tests, benchmarks, scripts) the policy is the defaults with the environment's
overrides. The ``DGPP_*`` variables below are the documented overrides (``docs/configuration.md``) and this is
the one module that reads them: kernel and layer code asks ``current()`` instead, so a switch has one name, one
default and one place to look. Per-step facts (which rows of a step take which kernel) are not policy: they
ride on the step's ``ForwardBatch`` (``dgpp.step.route``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

DECODE_GEMV_SETTINGS = ("auto", "row", "mma")
ROW_BLOCKS = (16, 32, 64)


@dataclass(frozen=True)
class ExecPolicy:
    """Every switch that picks a kernel or a path, fixed for the process's life (a row's bits must never depend
    on when a switch was flipped). Field comments name the override variable."""

    batch_invariant: bool = False  # engine.batch_invariant; DGPP_BATCH_INVARIANT=1 (no engine)
    exact_routing: bool = True  # rows routed to canonical CUDA kernels; DGPP_EXACT=0 turns it off (A/B)
    quant_decode_gemv: str | None = None  # engine.quant_decode_gemv; DGPP_QUANT_GEMV=row|mma wins (A/B)
    decode_max_rows: int = 1  # the most rows a decode or verify step holds ("auto" resolves from it)
    packed_decode_gemv: bool = True  # DGPP_QUANT_GEMV=0: packed decode rows take the weight-only GEMM
    quant_torch_only: bool = False  # DGPP_QUANT_TORCH=1: packed weights decoded, then F.linear (reference)
    bf12_triton: bool = False  # DGPP_BF12_TRITON=1: the bf12 Triton GEMV on a GPU
    # int4 words with bf16 scales decoded in inline PTX (the fp32 decode's bits, fewer instructions); DGPP_INT4_PTX=0 off
    int4_ptx: bool = True
    # the row-exact int GEMM meets each decoded weight tile with one dot of up to 64 rows (``IntRowsTile.one_dot``)
    # where a device probe finds it gives the 16-row dots' bits; DGPP_INT_ROWS_ONE_DOT=0: a dot per 16 rows (A/B)
    int_rows_one_dot: bool = True
    triton_kernels: bool = True  # DGPP_KERNELS=torch: the torch references on a GPU (A/B)
    dense_gemv: bool = True  # DGPP_GEMV=0: dense decode rows take cuBLAS instead of the Triton GEMV
    gemv_head: bool = False  # DGPP_GEMV_HEAD=1: the LM head through the Triton GEMV
    gemv_split: bool = True  # DGPP_GEMV_SPLIT=0: the dense GEMV never splits K of narrow outputs (A/B)
    prefill_attention: str = "triton"  # DGPP_PREFILL_ATTN=torch: the torch prefill attention on a GPU
    exact_row_block: int = 64  # DGPP_EXACT_ROW_BLOCK: rows per tile of the fixed-order GEMM (16, 32, 64)
    exact_wide_bn: bool = True  # DGPP_EXACT_WIDE_BN=0: no wide output tile for prefill-size fixed-order calls
    exact_prefill_tile: bool = (
        True  # DGPP_EXACT_PREFILL_TILE=0: prefill-size fixed-order calls keep the GEMV tiles
    )
    # DGPP_EXACT_GROUP_ROWS: prefill chunks of at most this many rows take the fixed-order linears together in one
    # call per weight (0: every chunk in cuBLAS calls of its own); dgpp.nn.exact.routing
    exact_group_rows: int = 256
    exact_splits: int = 32  # DGPP_EXACT_SPLITS: pinned split count of the canonical decode attention
    overlap_steps: bool = (
        True  # DGPP_OVERLAP=0: no overlapped decode steps on a GPU (dgpp.sched.overlap; A/B)
    )
    # the lossy prefill levers: engine keys only (no variable turns on a lossy path); dgpp.step.prefill_rows
    prefill_bf16_partials: bool = False  # engine.prefill_bf16_partials
    prefill_fp8_gemm: bool = False  # engine.prefill_fp8_gemm

    def __post_init__(self) -> None:
        if self.quant_decode_gemv not in (None, *DECODE_GEMV_SETTINGS):
            raise ValueError(
                f"engine.quant_decode_gemv must be auto, row or mma, not {self.quant_decode_gemv!r}"
            )
        if self.exact_row_block not in ROW_BLOCKS:
            raise ValueError(f"DGPP_EXACT_ROW_BLOCK must be 16, 32 or 64, got {self.exact_row_block}")
        if self.exact_group_rows < 0:
            raise ValueError(f"DGPP_EXACT_GROUP_ROWS must be 0 or more, got {self.exact_group_rows}")

    @classmethod
    def for_engine(
        cls,
        *,
        batch_invariant: bool,
        quant_decode_gemv: str,
        decode_max_rows: int,
        prefill_bf16_partials: bool = False,
        prefill_fp8_gemm: bool = False,
    ) -> ExecPolicy:
        """An engine's policy: its keys, then the environment's A/B overrides (``engine.batch_invariant`` is the
        engine's own: ``DGPP_BATCH_INVARIANT`` only sets the default where no engine is configured)."""
        base = cls(
            quant_decode_gemv=quant_decode_gemv,
            decode_max_rows=decode_max_rows,
            prefill_bf16_partials=prefill_bf16_partials,
            prefill_fp8_gemm=prefill_fp8_gemm,
        )
        return dataclasses.replace(with_environment(base), batch_invariant=batch_invariant)


def _flag(name: str, on: str) -> bool | None:
    """Whether variable ``name`` is on (its value is ``on``; ``"!0"``: anything but 0), None when it is unset."""
    raw = os.environ.get(name)
    if raw is None:
        return None
    return raw != "0" if on == "!0" else raw == on


def with_environment(base: ExecPolicy) -> ExecPolicy:
    """``base`` with every ``DGPP_*`` override that is set in the environment (the one place they are read)."""
    env = os.environ
    changes: dict[str, object] = {}
    for field, name, on in (
        ("batch_invariant", "DGPP_BATCH_INVARIANT", "1"),
        ("exact_routing", "DGPP_EXACT", "!0"),
        ("quant_torch_only", "DGPP_QUANT_TORCH", "1"),
        ("bf12_triton", "DGPP_BF12_TRITON", "1"),
        ("int4_ptx", "DGPP_INT4_PTX", "!0"),
        ("int_rows_one_dot", "DGPP_INT_ROWS_ONE_DOT", "!0"),
        ("dense_gemv", "DGPP_GEMV", "!0"),
        ("gemv_head", "DGPP_GEMV_HEAD", "1"),
        ("gemv_split", "DGPP_GEMV_SPLIT", "!0"),
        ("exact_wide_bn", "DGPP_EXACT_WIDE_BN", "!0"),
        ("exact_prefill_tile", "DGPP_EXACT_PREFILL_TILE", "!0"),
        ("overlap_steps", "DGPP_OVERLAP", "!0"),
    ):
        value = _flag(name, on)
        if value is not None:
            changes[field] = value
    gemv = env.get("DGPP_QUANT_GEMV")
    if gemv == "0":
        changes["packed_decode_gemv"] = False
    elif gemv in ("row", "mma"):
        changes["quant_decode_gemv"] = gemv
    if "DGPP_KERNELS" in env:
        changes["triton_kernels"] = env["DGPP_KERNELS"] != "torch"
    if "DGPP_PREFILL_ATTN" in env:
        changes["prefill_attention"] = "torch" if env["DGPP_PREFILL_ATTN"] == "torch" else "triton"
    for field, name in (
        ("exact_row_block", "DGPP_EXACT_ROW_BLOCK"),
        ("exact_splits", "DGPP_EXACT_SPLITS"),
        ("exact_group_rows", "DGPP_EXACT_GROUP_ROWS"),
    ):
        if name in env:
            changes[field] = int(env[name])
    return dataclasses.replace(base, **changes)


_installed: list[ExecPolicy] = []


def current() -> ExecPolicy:
    """The process's policy: the one installed at startup, else the defaults with the environment's overrides
    (read on first use)."""
    if not _installed:
        _installed.append(with_environment(ExecPolicy()))
    return _installed[-1]


def install(policy: ExecPolicy) -> None:
    """Make ``policy`` the process's (the engine does this once, before its model loads)."""
    _installed[:] = [policy]


@contextmanager
def overriding(**changes: object) -> Iterator[ExecPolicy]:
    """The current policy with ``changes`` for the duration (benchmarks' A/B runs, tests), then the previous one."""
    previous = current()
    install(dataclasses.replace(previous, **changes))
    try:
        yield current()
    finally:
        install(previous)
