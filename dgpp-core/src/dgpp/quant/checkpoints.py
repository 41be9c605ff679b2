"""Whole-checkpoint tools: quantize a dense checkpoint into a release-style quantized one (test fixtures),
and dequantize a quantized checkpoint into a dense one (so transformers can be the reference).

Both walk the safetensors files of a directory; module formats come from ``quantization_config``
exactly as the engine resolves them (``QuantScheme``), so the reference sees the values the engine serves.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dgpp.errors import CheckpointError
from dgpp.quant.encode import encode
from dgpp.quant.format import QuantFormat
from dgpp.quant.scheme import KEY, QuantScheme

_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _read_all(src: Path) -> dict[str, torch.Tensor]:
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def _write(dst: Path, src: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for side in _SIDE_FILES:
        if (src / side).exists():
            shutil.copy(src / side, dst / side)
    return dst


def quantize_checkpoint(
    src: str | Path,
    dst: str | Path,
    quantization_config: dict[str, Any],
    modules: str = r".*\.layers\.\d+\..*",
) -> Path:
    """Encode every 2-D ``<module>.weight`` whose module matches the regex ``modules`` and that the
    config resolves to a format; writes ``dst`` with ``quantization_config`` in its config.json."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    config[KEY] = quantization_config
    scheme = QuantScheme.from_hf_config(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in _read_all(src).items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        fmt = scheme.format_for(module) if module and t.dim() == 2 and re.fullmatch(modules, module) else None
        if fmt is None:
            out[name] = t
            continue
        for suffix, packed in encode(fmt, t.float()).items():
            out[f"{module}.{suffix}"] = packed
    return _write(dst, src, out, config)


def _module_tensors(
    tensors: dict[str, torch.Tensor], module: str, fmt: QuantFormat, shape: tuple[int, int]
) -> dict[str, torch.Tensor]:
    names = list(fmt.tensor_shapes(shape))
    return {
        s: tensors[f"{module}.{s}"] for s in (*names, *fmt.optional_tensors()) if f"{module}.{s}" in tensors
    }


def _shape_hint(tensors: dict[str, torch.Tensor], module: str, fmt: QuantFormat) -> tuple[int, int]:
    """The logical [N, K] of a quantized module, from what it stores."""
    declared = tensors.get(f"{module}.weight_shape")
    if declared is not None:
        return tuple(int(v) for v in declared.tolist())
    if f"{module}.qweight" in tensors:  # GPTQ: [K*b/32, N]
        qweight = tensors[f"{module}.qweight"]
        return qweight.shape[1], qweight.shape[0] * 32 // fmt.bits
    data_name = getattr(fmt, "data_name", "weight")
    data = tensors[f"{module}.{data_name}"]
    per_byte = 2 if fmt.name in ("nvfp4_modelopt", "nvfp4_ct", "mxfp4") else 1
    return data.shape[0], data.shape[1] * per_byte


def dequantize_checkpoint(src: str | Path, dst: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Decode every quantized module of ``src`` to a dense ``<module>.weight`` in ``dtype`` and drop
    ``quantization_config``: a checkpoint transformers loads as an ordinary dense model."""
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    scheme = QuantScheme.from_hf_config(config)
    tensors = _read_all(src)
    if scheme is None:
        return _write(dst, src, tensors, config)
    markers = ("weight_scale_inv", "weight_scale", "weight_packed", "qweight")
    modules = sorted({n.rsplit(".", 1)[0] for n in tensors if n.rsplit(".", 1)[-1] in markers})
    out = dict(tensors)
    for module in modules:
        fmt = scheme.format_for(module)
        if fmt is None:
            raise CheckpointError(
                f"{module}: stores quantized tensors but quantization_config resolves it to dense"
            )
        shape = _shape_hint(tensors, module, fmt)
        own = _module_tensors(tensors, module, fmt, shape)
        fmt.check(own, shape, module)
        dense = fmt.decode(fmt.prepare(own, shape), shape, dtype)
        for suffix in own:
            out.pop(f"{module}.{suffix}", None)
        for extra in ("input_scale", "input_global_scale", "weight_shape", "g_idx"):
            out.pop(f"{module}.{extra}", None)
        out[f"{module}.weight"] = dense
    config.pop(KEY, None)
    return _write(dst, src, out, config)
