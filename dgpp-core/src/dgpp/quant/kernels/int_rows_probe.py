"""Whether the row-exact int GEMM's one dot over a program's row blocks (``IntRowsTile.one_dot``) gives every row
the bits of its 16-row dots on this device, and is no slower: probed once per format, shape, tile, dtype and device,
on the layer's own weights.

Both forms run the same K steps in the same order, so a row's chain is fixed by construction up to the tensor-core
instruction: on Hopper both are wgmma, 16 rows wide or up to 64, and only the device can say whether the width
enters a column's sums. The 16-row dots are the reference (their rows equal the row alone)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dgpp.quant.kernels.batch_probe import PROBE_ROWS, launch_time_us, probed_once

# (format, shape, tile, dtype, device) -> one dot kept (bit-identical to the 16-row dots and no slower) or not
_ONE_DOT: dict[tuple[object, ...], bool] = {}


def one_dot_exact(
    key: tuple[object, ...],
    launch: Callable[[torch.Tensor, bool], torch.Tensor],
    k: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Callable[[Callable[[], object], torch.device], float] = launch_time_us,
) -> bool:
    """True when ``launch(rows, True)`` (one dot) gives an 80-row and a 24-row call the bits of
    ``launch(rows, False)`` (a dot per 16 rows) and takes no longer at 64 rows (``timer``; off CUDA every form
    ties): full programs of four blocks, the step the form is for (at 80 rows the partial program's one dot
    multiplies 48 empty rows, which a batch of 64 never pays). A form that fails to compile is not kept. Never
    probed inside a CUDA-graph capture: False then, uncached (the 16-row dots need no probe)."""

    def probe() -> bool:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(PROBE_ROWS, k, generator=gen, device=device).to(dtype)
        for rows in (x, x[:24]):  # dots of 64 rows (and a partial program), and of 32
            want = launch(rows, False)
            try:
                got = launch(rows, True)
            except Exception:  # noqa: BLE001 (a dot that does not compile or fit on this device is no candidate)
                return False
            if not torch.equal(got, want):
                return False
        full = x[:64]
        return timer(lambda: launch(full, True), device) <= timer(lambda: launch(full, False), device)

    return bool(probed_once(_ONE_DOT, key, device, probe))
