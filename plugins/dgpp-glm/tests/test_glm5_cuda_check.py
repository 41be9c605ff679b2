"""The GPU check's tiny-model comparison (tests/perf/check_glm5_cuda.py), run here with the MLA Triton kernels
under the interpreter: its model computes in the config's dtype (fp32), and layer 0's attention through the
kernels (absorption products, absorbed attention over dense and selected rows, un-absorption) matches the torch
path on the same queries and selection to fp32 rounding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "perf"))

import check_glm5_cuda as check  # noqa: E402


@pytest.mark.slow
def test_the_gpu_checks_tiny_model_is_fp32_and_its_kernels_match_the_torch_path(monkeypatch) -> None:
    from dgpp.kernels import head_matmul, mla_attention
    from dgpp.policy import current, overriding
    from dgpp.testing import conformance as conf

    # stand in for CUDA: the kernels run on CPU tensors (interpreter) unless the policy asks for the torch path
    for module in (head_matmul, mla_attention):
        monkeypatch.setattr(module, "use_triton", lambda x: current().triton_kernels)
    model = check.build_glm5(check.tiny_fp32_config(), device="cpu", std=0.08)
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.float32}
    attn = model.model.layers[0].self_attn
    assert attn.cache_spec().dtype == torch.float32
    prompts = conf.make_prompts(512, (11, 23, 4, 1), seed=2)  # rows past index_topk 8 attend a selection
    with overriding(batch_invariant=True), torch.inference_mode():
        err = check.layer_paths(model, prompts, "cpu")
    assert err < 1e-5
