"""Cache pools owned by the engine: paged K/V blocks shared by all requests, and state slots.

A family never allocates per-request memory itself: its layers read and write these tensors
through the ``ForwardBatch`` (``batch.cache``), keyed by the layer names of ``Model.cache_spec()``.
"""

from __future__ import annotations

import torch

from dgpp.step.cache_spec import CacheSpec, PagedKV, StateSpec


class CachePools:
    """``kv[name] = (k, v)`` each ``[num_blocks, block_size, kv_heads, dim]``;
    ``state[name][tensor] = [num_slots, *shape]``. Slot/block 0.. are plain indices; the
    allocators that hand them out (block manager, slot allocator) live with the scheduler.
    An entry stored as e4m3 rows (``engine.kv_dtype: fp8``, ``dgpp.step.cache_spec.stored_as``) also has
    ``kv_scales[name] = (k_scale, v_scale)``, fp32 ``[num_blocks, block_size, kv_heads, 1]``: indexed by the
    same blocks, so block tables and prefix sharing carry the scales with their codes. An entry with no scaled
    second tensor (a quantized MLA latent's ``k_rot``, DSA index keys with no V) has an empty ``v_scale``
    (last dim 0)."""

    def __init__(
        self,
        spec: dict[str, CacheSpec],
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kv_scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        for name, s in spec.items():
            if isinstance(s, PagedKV):
                rows = s.rows_per_block(block_size)  # fewer than block_size for compressed entries
                k_width, k_dtype = s.k_storage  # a quantized latent: e4m3 codes or packed fp4 bytes
                k = torch.zeros(num_blocks, rows, s.num_kv_heads, k_width, dtype=k_dtype, device=device)
                v = torch.zeros(num_blocks, rows, s.num_kv_heads, s.v_dim, dtype=s.dtype, device=device)
                self.kv[name] = (k, v)
                if s.row_scaled:
                    shape = (num_blocks, rows, s.num_kv_heads)
                    self.kv_scales[name] = (
                        torch.zeros(*shape, 1, dtype=torch.float32, device=device),
                        torch.zeros(*shape, int(s.v_scaled), dtype=torch.float32, device=device),
                    )
            elif isinstance(s, StateSpec):
                self.state[name] = {
                    t: torch.zeros(num_state_slots, *shape, dtype=dtype, device=device)
                    for t, (shape, dtype) in s.tensors.items()
                }
            else:  # pragma: no cover - a new spec kind must be taught to the pools
                raise TypeError(f"unknown cache spec for {name}: {s!r}")

    def zero_state(self, slot: int) -> None:
        """Reset a slot's state (a sequence starting at position 0 begins from zeros)."""
        for tensors in self.state.values():
            for t in tensors.values():
                t[slot].zero_()

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every layer's state from slot ``src`` to ``dst`` (snapshot and restore)."""
        for tensors in self.state.values():
            for t in tensors.values():
                t[dst].copy_(t[src])

    def kv_bytes(self) -> int:
        pairs = [*self.kv.values(), *self.kv_scales.values()]
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in pairs)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.state.values() for t in ts.values())
