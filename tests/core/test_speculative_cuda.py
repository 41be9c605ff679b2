"""Speculative decoding on a CUDA machine (skipped without a GPU): greedy MTP must equal plain greedy through the
CUDA kernels too, where a verify's 1+depth rows take the multi-row attention / GDN paths and plain decode the
one-row ones, in fp32 and bf16.

    python tests/core/test_speculative_cuda.py prepare --dir .cache/spec_gpu   # CPU host: tiny checkpoints
    python tests/core/test_speculative_cuda.py check --dir .cache/spec_gpu     # GPU: exits non-zero on a difference

``check`` loads through the family loaders directly (no installed entry points needed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_speculative import PROMPTS, random_qwen35_drafter, serve  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CASES = {"glm": (1, 3), "qwen3_5": (2,)}  # family -> depths


def prepare(root: Path) -> None:
    from dgpp.testing.builders import build_tiny_checkpoint
    from dgpp_glm.testing_glm4 import build_tiny_glm4_moe

    for tag, dtype in DTYPES.items():
        print("prepared", build_tiny_glm4_moe(root / f"glm_{tag}", seed=21, dtype=dtype))
        print("prepared", build_tiny_checkpoint("qwen3_5", root / f"qwen3_5_{tag}", seed=23, dtype=dtype))


def _load(path: Path, family: str):
    from dgpp.family import LoadContext

    hf_config = json.loads((path / "config.json").read_text())
    ctx = LoadContext(
        checkpoint_dir=path,
        hf_config=hf_config,
        family=family,
        architecture=hf_config["architectures"][0],
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    if family == "glm":
        from dgpp.plugins import manager
        from dgpp.startup.loading import model_for

        pm = manager()
        model = model_for(ctx, pm)
        return model, pm.hook.dgpp_build_draft(ctx=ctx, model=model)
    from dgpp_qwen.loader import load_model as load_qwen

    model = load_qwen(ctx)
    return model, random_qwen35_drafter(model, seed=24)


def check(root: Path) -> int:
    failures = 0
    for family, depths in CASES.items():
        for tag in DTYPES:
            model, drafter = _load(root / f"{family}_{tag}", "glm" if family == "glm" else "qwen")
            plain, _ = serve(model)
            transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
            runs = {f"mtp{d}": serve(model, drafter, d) for d in depths}
            runs["oracle3"] = serve(model, depth=3, oracle=transcripts)
            runs["half2"] = serve(model, depth=2, oracle=transcripts, wrong_from=1)
            for name, (spec, sched) in runs.items():
                st = sched.speculative.stats
                same = spec == plain
                failures += not same
                print(
                    f"{family:8s} {tag:5s} {name:8s} {'IDENTICAL' if same else 'DIFFERENT'} "
                    f"accepted {st.num_accepted_tokens_total}/{st.num_draft_tokens_total}"
                )
                if not same:
                    for key in plain:
                        if plain[key] != spec[key]:
                            print(f"    {key}: plain {plain[key]} mtp {spec[key]}")
    return 1 if failures else 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_mtp_equals_plain(tmp_path):
    prepare(tmp_path)
    assert check(tmp_path) == 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("prepare", "check") or sys.argv[2] != "--dir":
        sys.exit(__doc__)
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[3]))
    else:
        sys.exit(check(Path(sys.argv[3])))
