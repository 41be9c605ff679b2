"""The compute dtypes dgpp runs a model in, by the names config.json (``torch_dtype`` / ``dtype``) and the
deployment's ``engine.dtype`` use for them."""

from __future__ import annotations

import torch

# insertion order is the order error messages list the supported names in
COMPUTE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
