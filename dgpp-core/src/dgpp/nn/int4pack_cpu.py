"""Products against int4-packed weights on the CPU, each output row independent of the rows beside it.

torch's CPU int4 product (``aten._weight_int4pack_mm_for_cpu``) reads 4-bit codes ``q`` in its own blocked
layout and, per group of ``GROUP`` inputs and per output feature, a scale ``s`` and a zero ``z`` in the
activation dtype. It makes each weight as ``fma(q - 8, s, z)`` in fp32, sums ``x * w`` over the inputs in
ascending order with fp32 FMAs, and rounds each sum once to the activation dtype. With fp32 scales the weights
are exactly what the scales say (a GGUF Q4_1 block is ``s = d``, ``z = m + 8 d``), but only bf16 activations
take the vectorized kernel: fp32 and fp16 run a scalar loop about 50x slower, so the product here is always a
bf16 one (inputs rounded to bf16, scales and zeros in bf16, outputs rounded to bf16 and cast back). That is a
lossy chain against decode-then-multiply, which is why only an explicit key installs it
(``engine.gguf_weights: int4pack``, ``dgpp.checkpoint.gguf_packed``).

Every row is its own chain in the kernel, yet tiles of 4 rows and the thread split could still change a row's
bits with its batch; as for the bf16 products (``dgpp.nn.batch_invariant``) each shape is checked once per
process and thread count on random data against the row alone, at the row counts where CPU kernels change
their tiles: several rows a call where every row keeps the bits of the row alone, else one row a call.
"""

from __future__ import annotations

import torch
from torch import nn

from dgpp.nn.batch_invariant import ROW_BATCH, rows_alone, rows_match
from dgpp.nn.mlp import silu_and_mul
from dgpp.nn.second_core import SPLIT_MIN_OUTPUTS, on_two_cores, spare_core, split_verdict

GROUP = 32  # inputs per scale and zero (a GGUF block)
OUT_MULTIPLE = (
    16  # the product takes output blocks of 16, 32, 48 or 64: other counts are padded with zero rows
)
LAYOUT_ROWS = 64  # the packed layout blocks output features by 64 (AVX512; 32 on AVX2): parts that are
# whole multiples of it can be concatenated packed
_row_limits: dict[tuple[int, int, int], int] = {}


def int4pack_available() -> bool:
    """Whether this torch has the CPU int4 product and its packing op."""
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        aten, "_convert_weight_to_int4pack_for_cpu"
    )


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``codes [N, K]`` (values 0..15) in the CPU int4 product's packed layout (``[N, K / 2]`` uint8)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def int4pack_product(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    """``x [rows, K] @ W.T`` for bf16 ``x``: one call of the CPU int4 product (``scale_zeros [K / GROUP, N, 2]``)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu.default(x, packed, GROUP, scale_zeros)


def int4pack_row_limit(out_features: int, in_features: int) -> int:
    """How many rows one call of the int4 product of an ``[out, in]`` weight may hold with every row given the
    bits of the row alone: ``ROW_BATCH`` where calls of 2..``ROW_BATCH`` rows agree with the row alone on random
    codes, scales and inputs, else 1. Checked once per shape and thread count."""
    key = (out_features, in_features, torch.get_num_threads())
    limit = _row_limits.get(key)
    if limit is None:
        gen = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (out_features, in_features), generator=gen)
        scale_zeros = torch.randn(in_features // GROUP, out_features, 2, generator=gen).to(torch.bfloat16)
        x = torch.randn(ROW_BATCH, in_features, generator=gen).to(torch.bfloat16)
        with torch.inference_mode():
            packed = pack_codes(codes)

            def product(rows: torch.Tensor) -> torch.Tensor:
                return int4pack_product(rows, packed, scale_zeros)

            limit = ROW_BATCH if rows_match(product, x, rows_alone(product, x)) else 1
        _row_limits[key] = limit
    return limit


class Int4PackedWeight(nn.Module):
    """An ``[out_features, in_features]`` weight kept as int4 codes with a bf16 scale and zero per ``GROUP`` inputs.

    ``planes`` > 1: the weight is the sum of that many int4 planes laid side by side along K (an int8 code as its
    high and low nibble), each multiplying the same input, so the product runs on an input repeated ``planes``
    times: one chain over ``planes * in_features`` terms. ``from_codes`` pads the outputs to ``OUT_MULTIPLE``."""

    def __init__(
        self,
        packed: torch.Tensor,
        scale_zeros: torch.Tensor,
        out_features: int,
        in_features: int,
        planes: int = 1,
    ) -> None:
        super().__init__()
        rows = scale_zeros.shape[1]  # packed outputs: out_features, or more where padded
        if (
            scale_zeros.shape != (planes * in_features // GROUP, rows, 2)
            or rows % OUT_MULTIPLE
            or rows < out_features
        ):
            raise ValueError(
                f"int4 scales and zeros of shape {tuple(scale_zeros.shape)} do not fit a "
                f"[{out_features}, {in_features}] weight in {planes} plane(s)"
            )
        self.out_features, self.in_features, self.planes, self.rows = out_features, in_features, planes, rows
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scale_zeros", scale_zeros.to(torch.bfloat16).contiguous(), persistent=False)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale_zeros: torch.Tensor, planes: int = 1) -> Int4PackedWeight:
        """The weight of ``codes [N, planes * K]`` (0..15) and ``scale_zeros [planes * K / GROUP, N, 2]``."""
        out_features, pad = codes.shape[0], -codes.shape[0] % OUT_MULTIPLE
        if pad:  # zero scales and zeros: the padded outputs are 0, and are cut off
            codes = torch.cat((codes, codes.new_zeros(pad, codes.shape[1])))
            scale_zeros = torch.cat((scale_zeros, scale_zeros.new_zeros(scale_zeros.shape[0], pad, 2)), dim=1)
        return cls(pack_codes(codes), scale_zeros, out_features, codes.shape[1] // planes, planes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        if rows == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if flat.dtype != torch.bfloat16:
            flat = flat.to(torch.bfloat16)
        if self.planes > 1:
            flat = flat.repeat(1, self.planes)
        elif not flat.is_contiguous():  # the kernel reads rows of K contiguous inputs
            flat = flat.contiguous()
        # a decode row needs no row limit (and no look-up of it)
        limit = 1 if rows == 1 else int4pack_row_limit(self.rows, self.planes * self.in_features)
        scale_zeros = self.contiguous_scale_zeros()
        if rows == 1 and self._splits():
            out = self._on_two_cores(flat)
        elif rows <= limit:
            out = int4pack_product(flat, self.packed, scale_zeros)
        else:
            out = torch.cat([int4pack_product(part, self.packed, scale_zeros) for part in flat.split(limit)])
        if self.rows != self.out_features:
            out = out[:, : self.out_features].contiguous()
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def _splits(self) -> bool:
        """Whether a decode row's product runs as two halves on two cores (``dgpp.nn.second_core``): a large
        product, a spare core, and halves checked once per shape to give the whole product's bits."""
        if self.rows < SPLIT_MIN_OUTPUTS or not spare_core():
            return False
        inputs = self.planes * self.in_features

        def halves_exact() -> bool:
            x = torch.randn(3, inputs, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            scale_zeros = self.contiguous_scale_zeros()
            return all(
                torch.equal(self._on_two_cores(row), int4pack_product(row, self.packed, scale_zeros))
                for row in x.split(1)
            )

        return split_verdict(("int4pack", self.rows, inputs), halves_exact)

    def _on_two_cores(self, row: torch.Tensor) -> torch.Tensor:
        """A row's product as two halves of the outputs (cut at a multiple of ``LAYOUT_ROWS``), one per core."""
        halves = getattr(self, "_halves", None)
        if halves is None or halves[0] is not self.packed:
            cut = self.rows // 2 // LAYOUT_ROWS * LAYOUT_ROWS
            scale_zeros = self.scale_zeros
            halves = (
                self.packed,
                (self.packed[:cut], scale_zeros[:, :cut].contiguous()),
                (self.packed[cut:], scale_zeros[:, cut:].contiguous()),
            )
            self._halves = halves
        (first, first_scales), (second, second_scales) = halves[1], halves[2]
        return on_two_cores(
            lambda: int4pack_product(row, first, first_scales),
            lambda: int4pack_product(row, second, second_scales),
        )

    def contiguous_scale_zeros(self) -> torch.Tensor:
        """The scales and zeros as the kernel reads them: a part of a joined weight
        (``Int4PackLinearMethod._joined``) holds a strided view of the joined scales, copied per call."""
        scale_zeros = self.scale_zeros
        return scale_zeros if scale_zeros.is_contiguous() else scale_zeros.contiguous()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, planes={self.planes}"


def concat_packed(parts: list[Int4PackedWeight]) -> Int4PackedWeight | None:
    """One ``Int4PackedWeight`` with the outputs of ``parts`` side by side (e.g. q, k and v), or None where the
    packed layout cannot be joined (an output count that is not a multiple of ``LAYOUT_ROWS``, mixed inputs)."""
    first = parts[0]
    if any(
        p.in_features != first.in_features
        or p.planes != first.planes
        or p.rows != p.out_features
        or p.out_features % LAYOUT_ROWS
        for p in parts
    ):
        return None
    return Int4PackedWeight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.scale_zeros for p in parts], dim=1),
        sum(p.out_features for p in parts),
        first.in_features,
        first.planes,
    )


class Int4PackLinearMethod:
    """``LinearMethod`` of a ``Linear`` whose weight is an ``Int4PackedWeight`` (``layer.int4_weight``), installed on
    a loaded layer in place of its dense weight (``adopt``). q/k/v and gate/up of such layers multiply as one
    product against their packed weights joined once (``fused_linears`` / ``fused_gate_up_silu``)."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise RuntimeError("Int4PackLinearMethod is installed on loaded layers only")

    @staticmethod
    def adopt(layer: nn.Module, weight: Int4PackedWeight) -> None:
        if "weight" in layer._parameters:
            del layer.weight
        layer.int4_weight = weight
        layer.quant_method = Int4PackLinearMethod()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = layer.int4_weight(x)
        return y if bias is None else y + bias

    @staticmethod
    def _joined(layers: tuple[nn.Module, ...]) -> Int4PackedWeight | None:
        cached = layers[0].__dict__.get("_dgpp_int4_joined")  # a plain attribute: no Module.__getattr__
        if cached is None or cached[0] != len(layers):
            if not all(
                isinstance(layer.quant_method, Int4PackLinearMethod) and layer.bias is None
                for layer in layers
            ):
                return None
            parts = [layer.int4_weight for layer in layers]
            joined = concat_packed(parts)
            if joined is not None:  # the parts become views of the joined weight: one copy stays resident
                start = 0
                for part in parts:
                    part.packed = joined.packed[start : start + part.rows]
                    part.scale_zeros = joined.scale_zeros[:, start : start + part.rows]
                    start += part.rows
            cached = (len(layers), joined)
            layers[0]._dgpp_int4_joined = cached
        return cached[1]

    @classmethod
    def fused_linears(cls, layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor] | None:
        joined = cls._joined(layers)
        if joined is None:
            return None
        return list(torch.split_with_sizes(joined(x), [layer.out_local for layer in layers], dim=-1))

    @classmethod
    def fused_gate_up_silu(cls, gate: nn.Module, up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        joined = cls._joined((gate, up))
        if joined is None:
            return None
        g, u = torch.split_with_sizes(joined(x), [gate.out_local, up.out_local], dim=-1)
        return silu_and_mul(g, u)
