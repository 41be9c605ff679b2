"""Kernels a decode step launches, per layer kind, counted on the CPU along the path a GPU takes.

One decode step of a model runs with every layer's ``x.is_cuda`` check answered yes, so each layer picks its
CUDA branch (the Triton kernels, run by Triton's interpreter on CPU tensors; ``TRITON_INTERPRET=1`` must be set
before Triton is imported), and ``torch.cuda.is_current_stream_capturing()`` answered yes, as inside the decode
graph's capture. Counted as one launch each:

- a Triton kernel launch (``name`` without its ``_kernel`` suffix);
- a torch op that writes memory (``aten.<op>``): an op that mutates an argument, or returns a tensor that shares
  no storage with its inputs. Views, no-op casts and bare allocations (``empty*``) launch nothing on a GPU;
- a host read of a device value (``sync:<op>``: ``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``.numpy()``)
  or an op whose result's size depends on the values (``nonzero``, ``masked_select``, ``unique``, a boolean-mask
  index, ``repeat_interleave`` by a tensor), which a captured graph cannot replay. On CPU tensors a copy to the
  host cannot be told from a no-op by device, so those methods count by name;
- a tensor built from host data inside the step (``sync:tensor``: ``torch.tensor`` / ``torch.as_tensor`` of Python
  values given a ``device``, or with dimensions; ``t.new_tensor(values)``): on a GPU a host-to-device copy, which
  a graph capture refuses (a zero-dimensional CPU constant is a scalar operand and copies nothing).

Ops are attributed to the decoder layer that runs them: from a layer's start (it, or any of its modules, is
called) to the next layer's start, and
the last layer to the end of the step, so every layer carries one residual add + norm boundary (the final
norm is the last layer's). Ops before the first layer and in ``compute_logits`` are ``outside``. A torch op
can be several CUDA kernels (a sort, an index_put), so a count is a lower bound on kernels, exact for Triton.
Code that asks ``x.device.type`` rather than ``x.is_cuda`` keeps its CPU branch (tensors stay on the CPU).

    TRITON_INTERPRET=1 python -m dgpp.bench.launches [--kinds qwen3,mimo,...] [--context 12] [--dtype bfloat16]
        [--kv-dtype auto|fp8|fp4]

Prints a markdown table: tiny checkpoint, layer kind, layers of that kind, ops per layer, which ops.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEFAULT_KINDS = ("qwen3", "mimo", "qwen3_5", "qwen3_5_moe", "flint", "qwen4_exp", "glm5_next", "deepseek_v4")
# ops that only allocate: no kernel runs until something writes the memory
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# ops that read a device value on the host
_SYNCS = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "item",
        "nonzero",
        "equal",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
    }
)
# tensor methods that read values on the host (counted by name: on a CPU tensor they copy nothing)
_HOST_READS = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu", torch.Tensor.numpy: "numpy"}
_IS_CUDA = torch._C.TensorBase.is_cuda
_FROM_HOST_DATA = frozenset({torch.tensor, torch.as_tensor, torch.Tensor.new_tensor})


def _copies_host_data(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether ``torch.tensor`` / ``torch.as_tensor`` built ``out`` from Python values that a GPU step would copy
    to the device: given a device, or with dimensions (a CPU tensor with dimensions meets CUDA operands only
    through a copy)."""
    if args and isinstance(args[0], torch.Tensor) and len(args) > 1:  # ``t.new_tensor(data)``: on t's device
        return not isinstance(args[1], torch.Tensor)
    data = args[0] if args else kwargs.get("data")
    if isinstance(data, torch.Tensor):
        return False
    return kwargs.get("device") is not None or (isinstance(out, torch.Tensor) and out.dim() > 0)


@dataclass
class StepLaunches:
    """One decode step's launches: per decoder layer (in order) and outside the layers."""

    layers: list[Counter[str]] = field(default_factory=list)
    outside: Counter[str] = field(default_factory=Counter)
    layer_kinds: list[str] = field(default_factory=list)

    def per_layer(self) -> list[int]:
        return [sum(c.values()) for c in self.layers]


class _Recorder:
    """Where the next launch goes (``None``: not counting), and whether a Triton kernel is running (its
    interpreter's own torch calls are the kernel's, not the model's)."""

    def __init__(self) -> None:
        self.target: Counter[str] | None = None
        self.in_kernel = 0

    def add(self, name: str) -> None:
        if self.target is not None and not self.in_kernel:
            self.target[name] += 1


class _CudaBranches(TorchFunctionMode):
    """Answers ``tensor.is_cuda`` with True outside Triton kernels, so layers take their CUDA branch."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_CUDA and not self.recorder.in_kernel:
            return True
        if func in _HOST_READS:
            self.recorder.add(f"sync:{_HOST_READS[func]}")
        out = func(*args, **(kwargs or {}))
        if func in _FROM_HOST_DATA and _copies_host_data(args, kwargs or {}, out):
            self.recorder.add("sync:tensor")
        return out


def _storages(values: Any) -> set[int]:
    found: set[int] = set()
    for v in values if isinstance(values, (list, tuple)) else (values,):
        if isinstance(v, torch.Tensor):
            found.add(v.untyped_storage().data_ptr())
        elif isinstance(v, (list, tuple)):
            found |= _storages(v)
    return found


def _writes_memory(func: Any, args: tuple, kwargs: dict, out: Any) -> bool:
    """True when ``func`` is a kernel on a GPU: it mutates an argument, or its result is new memory."""
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return True
    produced = _storages(out)
    return bool(produced) and not produced & _storages(list(args) + list(kwargs.values()))


def _sized_by_values(name: str, args: tuple) -> bool:
    """A boolean-mask index (it runs ``nonzero`` inside the op, out of the mode's sight) or a repeat by a tensor."""
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
        return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in args[1])
    return name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) == 1


class _CountOps(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _SYNCS:
            self.recorder.add(f"sync:{name}")
        elif _sized_by_values(name, args):
            self.recorder.add(f"sync:{name}")
        elif name not in _ALLOCATIONS and _writes_memory(func, args, kwargs, out):
            self.recorder.add(f"aten.{name}")
        return out


@contextlib.contextmanager
def _triton_launches(recorder: _Recorder) -> Iterator[None]:
    """Counts each interpreted Triton launch and marks the torch work inside it as the kernel's."""
    from triton.runtime import interpreter

    original = interpreter.InterpretedFunction.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return original(self, *args, **kwargs)
        name = self.fn.__name__
        recorder.add(name.removesuffix("_kernel").lstrip("_"))
        recorder.in_kernel += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.in_kernel -= 1

    interpreter.InterpretedFunction.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        interpreter.InterpretedFunction.run = original  # type: ignore[method-assign]


@contextlib.contextmanager
def cuda_path(recorder: _Recorder | None = None) -> Iterator[_Recorder]:
    """Inside: layers take their CUDA branches on CPU tensors, as in a decode graph's capture; launches go to
    ``recorder.target`` while it is set."""
    from dgpp.kernels import _triton

    if not _triton.HAS_TRITON or not _interpreted():
        raise RuntimeError(
            "counting launches on the CPU needs Triton and TRITON_INTERPRET=1 before it is imported"
        )
    recorder = recorder or _Recorder()
    capturing = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True  # type: ignore[assignment]
    try:
        with _triton_launches(recorder), _CudaBranches(recorder), _CountOps(recorder):
            yield recorder
    finally:
        torch.cuda.is_current_stream_capturing = capturing  # type: ignore[assignment]


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from dgpp.kernels.rmsnorm import _rms_norm_kernel

    return isinstance(_rms_norm_kernel, InterpretedFunction)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: its first ``ModuleList`` named ``layers`` (``model.layers`` in checkpoints)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            return module
    raise ValueError(f"{type(model).__name__} has no ModuleList named 'layers'")


def layer_kind(layer: nn.Module) -> str:
    """``mixer+mlp`` class names of a layer's children (norms left out), ``/window`` where any attention of
    the layer keeps a sliding window."""
    parts = [type(c).__name__ for c in layer.children() if "Norm" not in type(c).__name__]
    sliding = any(getattr(m, "window", None) for m in layer.modules())
    return "+".join(parts) + ("/window" if sliding else "")


def count_step(model: nn.Module, step: Any) -> StepLaunches:
    """Launches of ``step()`` (one decode step of ``model``), per decoder layer and outside them."""
    layers = decoder_layers(model)
    found = StepLaunches(layer_kinds=[layer_kind(layer) for layer in layers])
    recorder = _Recorder()
    counting = [False]

    def enter_layer(index: int) -> Any:
        def hook(_module: nn.Module, _args: Any) -> None:
            if counting[0]:
                recorder.target = found.layers[index]

        return hook

    def enter_model(_module: nn.Module, _args: Any) -> None:
        counting[0] = True
        found.layers = [Counter() for _ in layers]
        recorder.target = found.outside

    def leave_model(_module: nn.Module, _args: Any, _out: Any) -> None:
        recorder.target = None

    # every module of a layer marks it: a stack may call a layer's parts rather than the layer
    handles = [
        m.register_forward_pre_hook(enter_layer(i)) for i, layer in enumerate(layers) for m in layer.modules()
    ]
    handles += [model.register_forward_pre_hook(enter_model), model.register_forward_hook(leave_model)]
    original_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        recorder.target = found.outside if counting[0] else None
        try:
            return original_logits(hidden)
        finally:
            recorder.target = None

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    try:
        with cuda_path(recorder):
            step()
    finally:
        del model.compute_logits
        for h in handles:
            h.remove()
    return found


def count_decode(
    model: nn.Module, context: int = 12, block_size: int = 16, kv_dtype: str = "auto"
) -> StepLaunches:
    """Prefill ``context`` tokens of one sequence on the CUDA path, then count one decode step's launches; the cache
    stored as ``kv_dtype`` (``engine.kv_dtype``) says."""
    from dgpp.engine.runner import ModelRunner
    from dgpp.engine.work import SeqWork
    from dgpp.step.cache_spec import stored_as
    from dgpp.step.pools import CachePools

    blocks = -(-(context + 2) // block_size)
    pools = CachePools(stored_as(model.cache_spec(), kv_dtype), blocks, block_size, 1)
    runner = ModelRunner(model, pools)
    table = list(range(blocks))
    prompt = [(7 * i + 3) % 97 + 1 for i in range(context)]
    with cuda_path():
        first = int(runner.step([SeqWork(0, table, 0, prompt)])[0].argmax())
    return count_step(model, lambda: runner.step([SeqWork(0, table, context, [first])]))


def tiny_model(kind: str, dtype: torch.dtype = torch.float32) -> Any:
    """The tiny checkpoint ``kind`` (``dgpp_tiny_checkpoints``) loaded as ``dgpp serve`` loads it."""
    from dgpp.catalog import tiny_checkpoint
    from dgpp.config_schema import EngineConfig
    from dgpp.startup.loading import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_checkpoint(kind).build(tmp, seed=0, dtype=dtype)
        return load_model(path, EngineConfig(), dtype=dtype)


def _short(name: str) -> str:
    return name.removeprefix("aten.")


def table_rows(kind: str, launches: StepLaunches) -> list[str]:
    """Markdown rows: per layer kind, the count most of its layers launch and one such layer's ops in order."""
    rows = []
    counts = launches.per_layer()
    for lk in dict.fromkeys(launches.layer_kinds):
        idx = [i for i, k in enumerate(launches.layer_kinds) if k == lk]
        typical = Counter(counts[i] for i in idx).most_common(1)[0][0]
        sample = launches.layers[next(i for i in idx if counts[i] == typical)]
        ops = ", ".join(f"{_short(op)} x{n}" if n > 1 else _short(op) for op, n in sample.items())
        rows.append(f"| {kind} | {lk} | {len(idx)} | {typical} | {ops} |")
    outside = launches.outside
    rows.append(
        f"| {kind} | outside layers | - | {sum(outside.values())} | "
        + ", ".join(f"{_short(op)} x{n}" if n > 1 else _short(op) for op, n in outside.items())
        + " |"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dgpp.bench.launches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="tiny checkpoints, comma-separated")
    parser.add_argument("--context", type=int, default=12, help="tokens before the counted decode step")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the checkpoints' dtype (bf16, as served, shows its casts)",
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=("auto", "fp8", "fp4"),
        help="engine.kv_dtype of the counted cache",
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "set TRITON_INTERPRET=1 (the CUDA path's Triton kernels run in Triton's interpreter)",
            file=sys.stderr,
        )
        return 2
    lines = [
        "| checkpoint | layer kind | layers | ops/layer | ops (in launch order) |",
        "|---|---|---|---|---|",
    ]
    for kind in [k for k in args.kinds.split(",") if k]:
        model = tiny_model(kind, getattr(torch, args.dtype))
        lines += table_rows(kind, count_decode(model, args.context, kv_dtype=args.kv_dtype))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
