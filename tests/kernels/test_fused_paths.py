"""The fused CUDA paths (the Triton kernels, run here by the interpreter on CPU tensors) compute what the
torch ops of the CPU path compute: Qwen3's residual adds fused into the next RMSNorm, and whole models
(MiMo, Flint, Qwen3.5 dense and MoE, Qwen3.8-Flash-Next, GLM-4.x MoE with its group-limited router, DeepSeek-V4.1
with its sqrt-softplus router) on their CUDA branches."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dgpp.bench.models import build_random_model
from dgpp.engine.runner import build_batch
from dgpp.engine.work import SeqWork
from dgpp.step.pools import CachePools


def test_fused_residual_forward_equals_plain_loop(monkeypatch) -> None:
    from dgpp.kernels import rmsnorm

    model = build_random_model("tiny", "cpu", torch.float32, seed=5)
    outputs = []
    for fused in (False, True):
        pools = CachePools(model.cache_spec(), 8, 4, 2)
        work = [SeqWork(0, [0, 1, 2], 0, [5, 9, 11, 3, 7]), SeqWork(1, [3, 4], 0, [8, 1, 2])]
        batch = build_batch(work, pools)
        if fused:
            monkeypatch.setattr(rmsnorm, "use_triton", lambda x: True)
        with torch.inference_mode():
            outputs.append(model(batch))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_every_dispatcher_the_layers_call_exists() -> None:
    # the CUDA branches in dgpp.nn and the plugins call these by name; a CPU run never reaches them
    import inspect
    import re
    from pathlib import Path

    import dgpp
    import dgpp.kernels as kernels
    import dgpp_qwen

    roots = [Path(dgpp.__file__).parent / "nn", Path(dgpp_qwen.__file__).parent]
    used = set()
    for root in roots:
        for path in root.rglob("*.py"):
            used |= set(re.findall(r"\bkernels\.([a-z_]+)\(", path.read_text()))
    assert used, "no layer dispatches to dgpp.kernels"
    for name in used:
        fn = getattr(kernels, name, None)
        assert callable(fn) and not inspect.ismodule(fn), f"dgpp.kernels.{name} is not a dispatcher"


@pytest.mark.parametrize(
    "kind",
    [
        "mimo",
        "flint",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen4_exp",
        "glm4_moe",
        "glm5_next",
        "deepseek_v4",
        "deepseek_v41",
    ],
)
def test_cuda_path_computes_the_cpu_path(kind: str) -> None:
    """A model on its CUDA branches (Triton under the interpreter: residual adds fused into the next norm,
    projections sharing a launch, Flint's q/k norms fused with the rotation, the GDN gates and output norm in
    one launch each, the hyper-connections' collapse and expand one launch each, DeepSeek-V4's trailing RoPE in one
    launch) against its CPU path, fp32: a prompt and three greedy decode steps, logits within fp32
    rounding and the same tokens."""
    from dgpp.bench.launches import cuda_path, tiny_model
    from dgpp.engine.runner import ModelRunner

    model = tiny_model(kind)
    prompt = [5, 9, 11, 3, 7, 42, 8, 1, 2]
    runs = []
    for on_cuda_path in (False, True):
        runner = ModelRunner(model, CachePools(model.cache_spec(), 4, 16, 1))
        with cuda_path() if on_cuda_path else contextlib.nullcontext():
            logits = [runner.step([SeqWork(0, [0, 1], 0, prompt)])[0]]
            for step in range(3):
                token = int(logits[-1].argmax())
                logits.append(runner.step([SeqWork(0, [0, 1], len(prompt) + step, [token])])[0])
        runs.append(torch.stack(logits))
    torch.testing.assert_close(runs[1], runs[0], rtol=2e-5, atol=2e-5)
    assert torch.equal(runs[1].argmax(-1), runs[0].argmax(-1))


@pytest.mark.parametrize("kind", ["mimo", "qwen3_5_moe", "glm4_moe", "glm5_next", "deepseek_v4"])
def test_cuda_path_decode_rows_do_not_depend_on_the_batch(kind: str) -> None:
    """On the CUDA branches, a decode row's logits are the same bits alone and beside another sequence."""
    from dgpp.bench.launches import cuda_path, tiny_model
    from dgpp.engine.runner import ModelRunner

    model = tiny_model(kind)
    prompts = [[5, 9, 11, 3, 7, 42, 8], [17, 2, 30, 4]]
    tables = [[0, 1], [2, 3]]
    results = []
    for together in (False, True):
        runner = ModelRunner(model, CachePools(model.cache_spec(), 4, 16, 2))
        with cuda_path():
            first = [
                int(runner.step([SeqWork(i, tables[i], 0, p)])[0].argmax()) for i, p in enumerate(prompts)
            ]
            works = [SeqWork(i, tables[i], len(p), [first[i]]) for i, p in enumerate(prompts)]
            if together:
                results.append(runner.step(works))
            else:
                results.append(torch.cat([runner.step([w]) for w in works]))
    assert torch.equal(results[0], results[1])
