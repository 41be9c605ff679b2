"""The DSA index-score kernel (``dgpp.kernels.dsa_index``) compiled for sm_90 ahead of time, on a machine without a
GPU (Triton's NVIDIA backend ships ptxas/nvdisasm). Not a test: each key form the engine launches (bf16, e4m3 with
row scales, FP4 packed) at DeepSeek-V4's indexer shape (64 heads x 128 deep, 64-token tiles) must compile, and this
shows its SASS size, registers and stack a thread, and the layout its head sum reduces over (the layout fixes the
sum's order, so it must not change when the dot is sliced):

    PYTHONPATH=dgpp-core/src:tests/perf python3 tests/perf/sass_dsa_index.py
"""

from __future__ import annotations

import re

from sass_paged_attention import compile_sm90
from sass_quant_gemv import sass_summary

from dgpp.kernels import dsa_index

FORMS = {  # key pointer, its e4m3 view, row scales, packed
    "bf16": ("*bf16", "*bf16", False, False),
    "e4m3 + row scales": ("*fp8e4nv", "*fp8e4nv", True, False),
    "fp4 packed": ("*u8", "*fp8e4nv", False, True),
}


def main() -> None:
    for name, (keys, keys8, scales, packed) in FORMS.items():
        pointers = {
            **dict.fromkeys(("q_ptr", "w_ptr"), "*bf16"),
            "k_ptr": keys,
            "k8_ptr": keys8,
            "ksc_ptr": "*fp32",
            **dict.fromkeys(("bt_ptr", "lens_ptr"), "*i32"),
            "out_ptr": "*fp32",
            **dict.fromkeys(("scale", "w_scale"), "fp32"),
        }
        constexprs = {
            "BLOCK_T": dsa_index._BLOCK_T,
            "BLOCK_H": 64,
            "BLOCK_D": 128,
            "BLOCK_C": dsa_index._BLOCK_C,
            "HAS_SCALES": scales,
            "PACKED": packed,
            "KEY_BLOCK": 32,
            "KEY_E8M0": False,
        }
        compiled = compile_sm90(dsa_index._index_scores_kernel, pointers, constexprs)
        ttgir = compiled.asm["ttgir"]
        layouts = dict(re.findall(r"^(#blocked\d*) = (.*)$", ttgir, re.M))
        reduced = re.search(r"\}\) : \(tensor<[^,]*, (#blocked\d*)>\)", ttgir)
        head_sum = layouts[reduced.group(1)] if reduced else "?"
        print(f"{name}\n    {sass_summary(compiled)}\n    head sum over {head_sum}", flush=True)


if __name__ == "__main__":
    main()
