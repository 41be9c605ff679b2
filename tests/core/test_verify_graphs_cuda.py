"""Verify graphs on a CUDA machine (skipped without a GPU): captured verify steps replayed against the eager verify,
in fp32 and bf16, for the tiny GLM-4.7 (MTP drafter, hidden rows handed over), GLM-5.3 (MLA latents, DSA index keys,
its MTP drafter) and the tiny Qwen3 (prompt lookup).

- one step with mixed draft counts and padding rows: replayed logits (and GLM's hidden rows) equal the eager
  verify's bit for bit, and the pools end as the eager verifies leave them (padding rows write nothing);
- through the scheduler: greedy with drafts under graphs emits the plain (eager) greedy transcript, every decode
  pass replayed.

    python tests/core/test_verify_graphs_cuda.py prepare --dir .cache/verify_gpu   # CPU host: tiny checkpoints
    python tests/core/test_verify_graphs_cuda.py check --dir .cache/verify_gpu     # GPU: exits non-zero on a difference
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_lookup_draft import _greedy  # noqa: E402
from test_lookup_draft import serve as serve_lookup  # noqa: E402
from test_speculative import PROMPTS, serve  # noqa: E402
from test_speculative_cuda import DTYPES  # noqa: E402
from test_verify_graphs import BLOCKS_PER_SEQ, _clone_pools, _pools, _prefilled, _verify_work  # noqa: E402

from dgpp.engine.graphs import DecodeGraphs, verify_graphs  # noqa: E402
from dgpp.engine.runner import ModelRunner  # noqa: E402

FAMILIES = ("glm", "glm_dsa", "qwen3")


def prepare(root: Path) -> None:
    from dgpp.testing.builders import build_tiny_checkpoint
    from dgpp_glm.testing_glm4 import build_tiny_glm4_moe
    from dgpp_glm.testing_glm5 import build_tiny_glm_moe_dsa

    for tag, dtype in DTYPES.items():
        print("prepared", build_tiny_glm4_moe(root / f"glm_{tag}", seed=21, dtype=dtype))
        dsa = build_tiny_glm_moe_dsa(root / f"glm_dsa_{tag}", seed=7, dtype=dtype, mtp_layers=1)
        print("prepared", dsa)
        print("prepared", build_tiny_checkpoint("qwen3", root / f"qwen3_{tag}", seed=3, dtype=dtype))


def _load(path: Path, family: str):
    """The model on the GPU (and a GLM's MTP drafter; None for Qwen3) through the family loaders."""
    import json

    from dgpp.family import LoadContext
    from dgpp.plugins import manager
    from dgpp.startup.loading import model_for

    hf_config = json.loads((path / "config.json").read_text())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ctx = LoadContext(path, hf_config, family, hf_config["architectures"][0], device=device)
    pm = manager()
    model = model_for(ctx, pm)
    return model, pm.hook.dgpp_build_draft(ctx=ctx, model=model) if family == "glm" else None


def _step_failures(model) -> list[str]:
    """One captured set, three verify steps of mixed draft counts: replay vs eager, and the pools after."""
    failures = []
    prompts = [[5 + i for i in range(n)] for n in (7, 4, 10)]
    pools_graph, pools_eager = _pools(model, 3), _pools(model, 3)
    tables = _prefilled(model, pools_graph, prompts)
    _prefilled(model, pools_eager, prompts)
    graphs = verify_graphs(DecodeGraphs(model, pools_graph, 3, BLOCKS_PER_SEQ), model, 3)
    if graphs is None or not graphs.use_graphs:
        return ["no captured verify graphs"]
    graphs.capture()
    eager = ModelRunner(model, pools_eager)
    starts = [len(p) for p in prompts]
    for seed, counts in enumerate(([3, 3, 3], [0, 1, 3], [1, 0, 0])):
        work = _verify_work(tables, starts, counts, seed)
        replayed = graphs.run_work(work)
        hidden = None if model.last_hidden is None else model.last_hidden.clone()
        reference = eager.step(work, verify=True)
        if replayed is None or not torch.equal(replayed, reference):
            failures.append(f"logits differ at counts {counts}")
        if model.keep_hidden and (hidden is None or not torch.equal(hidden, model.last_hidden)):
            failures.append(f"hidden rows differ at counts {counts}")
        starts = [c + k + 1 for c, k in zip(starts, counts, strict=True)]
    for got, want in zip(_clone_pools(pools_graph), _clone_pools(pools_eager), strict=True):
        if not torch.equal(got, want):
            failures.append("the pools differ from the eager verifies' (a padding row wrote?)")
            break
    return failures


def check(root: Path) -> int:
    failures = 0
    for family in FAMILIES:
        for tag in DTYPES:
            glm = family.startswith("glm")
            model, drafter = _load(root / f"{family}_{tag}", "glm" if glm else "qwen")
            model.keep_hidden = glm
            problems = _step_failures(model)
            model.keep_hidden = False
            if family == "glm_dsa":
                plain, _ = serve(model)
                runs = {f"mtp{d}": serve(model, drafter, d, graphs=True) for d in (1, 2)}
            elif glm:
                plain, _ = serve(model)
                transcripts = {f"r{i}": PROMPTS[i] + plain[f"r{i}"] for i in range(len(PROMPTS))}
                runs = {f"mtp{d}": serve(model, drafter, d, graphs=True) for d in (1, 3)}
                runs["oracle3"] = serve(model, depth=3, oracle=transcripts, graphs=True)
                runs["half2"] = serve(model, depth=2, oracle=transcripts, wrong_from=1, graphs=True)
            else:
                lists, _ = serve_lookup(model, _greedy())
                plain = {f"r{i}": t for i, t in enumerate(lists)}
                runs = {}
                for depth in (3, 8):
                    out, sched = serve_lookup(
                        model, _greedy(), depth=depth, chunk=4, concurrency=4, graphs=True
                    )
                    runs[f"lookup{depth}"] = ({f"r{i}": t for i, t in enumerate(out)}, sched)
            for name, (spec, sched) in runs.items():
                graphs = sched.runner.graphs
                if spec != plain:
                    problems.append(f"{name}: greedy differs from plain")
                if graphs is None or not graphs.use_graphs or graphs.stats.replays < sched.stats.decode_steps:
                    problems.append(f"{name}: decode passes not replayed")
            failures += len(problems)
            print(f"{family:6s} {tag:5s} {'IDENTICAL' if not problems else 'DIFFERENT'}")
            for problem in problems:
                print(f"    {problem}")
    return 1 if failures else 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_verify_graphs_equal_eager(tmp_path):
    prepare(tmp_path)
    assert check(tmp_path) == 0


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("prepare", "check") or sys.argv[2] != "--dir":
        sys.exit(__doc__)
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[3]))
    else:
        sys.exit(check(Path(sys.argv[3])))
