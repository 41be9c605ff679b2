"""Hook implementations: everything this plugin tells dgpp. Only ``dgpp.hookimpl``-decorated functions count."""

from __future__ import annotations

from pathlib import Path

import torch

from dgpp.engine.memory import MemoryPlan
from dgpp.family import FamilySpec, LoadContext
from dgpp.hookspecs import hookimpl

FAMILY = "toy"
PLUGIN = "dgpp-example-plugin"


@hookimpl
def dgpp_families() -> list[FamilySpec]:
    from dgpp_example.checkpoint import ARCHITECTURE, MODEL_TYPE

    return [
        FamilySpec(
            name=FAMILY,
            plugin=PLUGIN,
            architectures=(ARCHITECTURE,),
            model_types=(MODEL_TYPE,),
            implemented=(ARCHITECTURE, MODEL_TYPE),
            description="two-layer toy transformer (example plugin)",
        )
    ]


@hookimpl
def dgpp_load_model(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None  # not ours: let the family's own plugin answer
    from dgpp_example.checkpoint import load_toy

    return load_toy(ctx.checkpoint_dir, ctx.hf_config, ctx.dtype, ctx.device)


@hookimpl
def dgpp_memory_plan(ctx: LoadContext):
    if ctx.family != FAMILY:
        return None
    from dgpp_example.checkpoint import parse_config
    from dgpp_example.model import ToyModel

    cfg = parse_config(ctx.hf_config)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = ToyModel(cfg)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    eng = ctx.engine
    return MemoryPlan.from_cache_spec(
        model.cache_spec(),
        weights=weights,
        activations_per_token=4 * (4 * cfg.hidden_size + cfg.intermediate_size),
        kv_capacity=eng.kv_capacity,
        max_concurrency=eng.max_concurrency,
        prefill_tokens=256,
    )


@hookimpl
def dgpp_deploy_templates() -> list[Path]:
    return [Path(__file__).with_name("toy_cpu.json")]
