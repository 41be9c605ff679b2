"""Random-weight models of real geometries, built straight in device memory, for benchmarks.

The geometries (a published model's HF config fields) are the family plugins' knowledge, offered through
``dgpp_bench_geometries`` and found here by name.

transformers builds the model from a config (its own random init), and dgpp's model takes that model's
tensors, so both run the very same weights. Nothing touches the disk. When two copies do not fit on the
device (a 27B hybrid in bf16 is 54 GB), dgpp's parameters *are* transformers' tensors (shared storage).
Geometries transformers cannot build (its version lacks the model type) or that the caller runs without
the HF baseline get dgpp's own random init (:func:`build_random_model`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dgpp.offers import PackedRelease
from dgpp.step.model import Model


def geometries() -> dict[str, dict[str, Any]]:
    """HF config.json fields of every geometry the installed family plugins offer (``dgpp_bench_geometries``)."""
    from dgpp.catalog import bench_geometries

    return {name: dict(offer.hf_config) for name, offer in bench_geometries().items()}


def split_layers(geometry: str) -> tuple[str, int | None]:
    """``NAME@N`` -> (NAME, N): the geometry cut to its first N decoder layers (a per-layer rate of a geometry
    whose whole weights do not fit the device); a plain name -> (name, None)."""
    base, sep, count = geometry.partition("@")
    if not sep:
        return geometry, None
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"geometry {geometry!r}: the layer count after '@' must be a positive integer")
    return base, int(count)


def first_layers(raw: dict[str, Any], layers: int) -> dict[str, Any]:
    """HF config fields of the first ``layers`` decoder layers: ``num_hidden_layers`` and every per-layer list
    (layer kinds, MLP kinds, hybrid patterns) cut alike."""
    total = int(raw["num_hidden_layers"])
    if layers > total:
        raise ValueError(f"the geometry has {total} layers; asked for the first {layers}")
    cut = {k: v[:layers] for k, v in raw.items() if isinstance(v, list) and len(v) == total}
    return {**raw, **cut, "num_hidden_layers": layers}


def hf_config(geometry: str, dtype: torch.dtype) -> dict[str, Any]:
    """The geometry's HF config fields with ``dtype``; a name no plugin offers is an error listing those offered.
    ``NAME@N`` keeps its first N layers (``split_layers``)."""
    base, layers = split_layers(geometry)
    known = geometries()
    if base not in known:
        raise ValueError(f"unknown geometry {base!r}; known: {', '.join(known)}")
    if layers is not None and _own_builder(base) is not None:
        raise ValueError(f"geometry {base!r} builds its own random model: it cannot be cut with '@{layers}'")
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    raw = known[base] if layers is None else first_layers(known[base], layers)
    return {**raw, "dtype": name, "torch_dtype": name}


def new_model(raw_config: dict[str, Any], device: torch.device | str) -> Model:
    """The model its family plugin builds for an HF config dict (``dgpp_build_model``), parameters uninitialised."""
    from dgpp.errors import UnsupportedModelError
    from dgpp.family import LoadContext
    from dgpp.plugins import manager, resolve

    pm = manager()
    found = resolve(pm, raw_config)
    ctx = LoadContext(
        checkpoint_dir=Path(),
        hf_config=raw_config,
        family=found.family.name,
        architecture=found.matched,
        device=device,
    )
    model = pm.hook.dgpp_build_model(ctx=ctx)
    if model is None:
        raise UnsupportedModelError(
            f"family {found.family.name} (plugin {found.family.plugin}) builds no model "
            "without a checkpoint (dgpp_build_model)"
        )
    return model


def transformers_knows(model_type: str) -> bool:
    """Whether the installed transformers can build ``model_type`` (the device's version may predate it)."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return False
    return model_type in CONFIG_MAPPING


@torch.inference_mode()
def build_pair(
    geometry: str,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    *,
    with_hf: bool = True,
) -> tuple[Model, torch.nn.Module | None]:
    """(dgpp model, transformers model) sharing the same random weights, both on ``device``. The
    transformers model is None when ``with_hf`` is off or transformers lacks the model type; dgpp's model
    then gets :func:`build_random_model`'s weights."""
    raw = hf_config(geometry, dtype)
    if _own_builder(geometry) is not None:
        if with_hf:
            print(
                f"{geometry}: its plugin draws the weights (packed formats): dgpp's model alone (HF column '-')"
            )
        return build_random_model(geometry, device, dtype, seed), None
    if not with_hf or not transformers_knows(raw["model_type"]):
        if with_hf:
            print(
                f"transformers has no model type {raw['model_type']!r}: dgpp's random model alone (HF column '-')"
            )
        return build_random_model(geometry, device, dtype, seed), None
    if _keeps_tables(raw):
        print(
            f"{geometry}: dgpp's model keeps tables outside its parameters, which transformers' weights do not "
            "fill by name: dgpp's random model alone (HF column '-')"
        )
        return build_random_model(geometry, device, dtype, seed), None
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in raw.items() if k != "architectures"})
    unnamed = _names_transformers_lacks(raw, config)
    if unnamed:
        print(
            f"{geometry}: transformers names the weights its own way (no {unnamed[0]!r}, which dgpp's model "
            "loads): dgpp's random model alone (HF column '-')"
        )
        return build_random_model(geometry, device, dtype, seed), None
    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ours = build_model_like(raw, hf.state_dict(), device, share=not _second_copy_fits(hf, device))
    return ours, hf


def _own_builder(geometry: str) -> Callable[[dict[str, Any], str, int], Any] | None:
    """The geometry's own random-model builder (``BenchGeometry.build``), if its plugin gives one."""
    from dgpp.catalog import bench_geometry

    return bench_geometry(split_layers(geometry)[0]).build


def packed_release(geometry: str) -> PackedRelease:
    """How the geometry's packed releases name and leave dense its modules (``BenchGeometry.release``)."""
    from dgpp.catalog import bench_geometry

    return bench_geometry(split_layers(geometry)[0]).release


def _keeps_tables(raw_config: dict[str, Any]) -> bool:
    """Whether dgpp's model (built on ``meta``) has modules with weights outside its parameters
    (``allocate_tables``, e.g. a lookup table loaded apart from the state dict)."""
    model = new_model(raw_config, "meta")
    return any(callable(getattr(type(m), "allocate_tables", None)) for m in model.modules())


def _names_transformers_lacks(raw_config: dict[str, Any], hf_config: Any) -> list[str]:
    """dgpp's parameter names that transformers' model of ``hf_config`` lacks (both built on ``meta``): the
    weights are handed over by name, so any one makes the pair impossible."""
    import transformers

    with torch.device("meta"):
        theirs = set(transformers.AutoModelForCausalLM.from_config(hf_config).state_dict())
    return [name for name, _ in new_model(raw_config, "meta").named_parameters() if name not in theirs]


def _second_copy_fits(module: torch.nn.Module, device: str, headroom: float = 1.25) -> bool:
    if torch.device(device).type != "cuda":
        return True
    need = sum(p.numel() * p.element_size() for p in module.parameters()) * headroom
    return torch.cuda.mem_get_info(torch.device(device))[0] > need


@torch.inference_mode()
def build_model_like(
    raw_config: dict[str, Any],
    state: dict[str, torch.Tensor],
    device: str,
    *,
    share: bool = False,
) -> Model:
    """A dgpp model for ``raw_config`` whose parameters come from ``state`` (HF names): copies, or with
    ``share`` the very tensors of ``state`` (no second copy; a write to one model then shows in both)."""
    # shared: build on the host, where the uninitialised (never touched) parameters cost no memory
    model = new_model(raw_config, "cpu" if share else device)
    for name, param in model.named_parameters():
        if name not in state:
            raise KeyError(f"benchmark weights have no tensor {name}")
        source = state[name]
        if share and source.shape == param.shape and source.dtype == param.dtype:
            param.data = source
        elif share:
            param.data = source.to(dtype=param.dtype, copy=True)
        else:
            param.copy_(source)
    return model.to(device)


def _init_value(model: torch.nn.Module, name: str, param: torch.Tensor) -> float | None:
    """The constant a 1-D parameter starts at (None: draw it): norms at their identity, ``(1 + w)`` norms at 0."""
    leaf = name.rpartition(".")[2]
    if leaf == "dt_bias":
        return 1.0
    owner = model.get_submodule(name.rpartition(".")[0])
    return 0.0 if getattr(owner, "zero_centered", False) else 1.0


def _fill_normal(param: torch.Tensor, std: float, gen: torch.Generator, chunk: int = 1 << 28) -> None:
    """N(0, std) drawn in fp32, in dim-0 slices for tensors over ``chunk`` elements (an expert stack is
    2.4G elements: one fp32 draw would need 10 GB)."""
    if param.numel() <= chunk:
        param.copy_(torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32) * std)
        return
    rows = max(1, chunk // max(1, param[0].numel()))
    for start in range(0, param.shape[0], rows):
        part = param[start : start + rows]
        part.copy_(torch.randn(part.shape, generator=gen, device=param.device, dtype=torch.float32) * std)


@torch.inference_mode()
def build_random_model(geometry: str, device: str, dtype: torch.dtype, seed: int = 0) -> Model:
    """A dgpp model with N(0, std) matrices, norms at identity and GDN decays as HF initialises them
    (A = U(1, 16), dt_bias 1); no transformers model kept. A geometry whose plugin builds its own random model
    (``BenchGeometry.build``) gets that one."""
    raw = hf_config(geometry, dtype)
    build = _own_builder(geometry)
    if build is not None:
        model: Model = build(raw, device, seed)
        return model
    return random_model_from_config(raw, device, seed)


@torch.inference_mode()
def random_model_from_config(raw: dict[str, Any], device: str, seed: int = 0) -> Model:
    """:func:`build_random_model` for HF config fields given whole (a geometry with keys added, e.g. a
    ``vision_config``); the dtype is the config's."""
    gen = torch.Generator(device=device).manual_seed(seed)
    model = new_model(raw, device)
    fill_random(model, float(raw.get("initializer_range", 0.02)), gen)
    from dgpp.startup.weights import settle_weights

    return settle_weights(model)  # the forms a loaded model keeps (e.g. MLA's kv_b_proj decoded)


@torch.inference_mode()
def fill_random(model: torch.nn.Module, std: float, gen: torch.Generator) -> None:
    """Every parameter of ``model`` (on ``gen``'s device) drawn as :func:`build_random_model` draws them; packed
    weights in their own format (``dgpp.bench.packed_random``)."""
    from dgpp.bench.packed_random import fill_packed

    device = gen.device
    packed = fill_packed(model, std, gen)
    for name, param in sorted(model.named_parameters()):
        if id(param) in packed:
            continue
        if name.endswith("A_log"):
            param.copy_((torch.rand(param.shape, generator=gen, device=device) * 15 + 1).log())
        elif name.endswith("tid2eid"):  # a hash router's token -> experts table: distinct experts per token
            experts = model.get_submodule(name.rpartition(".")[0]).cfg.num_experts
            picks = torch.rand(param.shape[0], experts, generator=gen, device=device).argsort(dim=-1)
            param.copy_(picks[:, : param.shape[1]])
        elif param.dim() == 1:
            param.fill_(_init_value(model, name, param))
        else:
            _fill_normal(param, std, gen)
    # weights a checkpoint loads apart from the parameters (e.g. a lookup table): such a module allocates them
    for module in model.modules():
        if callable(getattr(type(module), "allocate_tables", None)):
            for table in module.allocate_tables(device):
                _fill_normal(table, std, gen)


def weight_bytes_per_step(model: Model) -> int:
    """Bytes of weights a decode step reads: every parameter once, except the embedding table and a hash
    router's token table (one row per token is read; a tied LM head still reads it whole, counted once)."""
    total = 0
    # the embedding wherever the checkpoint's names put it (``model.`` or a wrapper's ``model.language_model.``)
    embed = next((m for name, m in model.named_modules() if name.endswith("embed_tokens")), None)
    tied = (
        getattr(model, "lm_head", None) is not None
        and embed is not None
        and model.lm_head.weight is embed.weight
    )
    for name, param in model.named_parameters():
        if (name.endswith("embed_tokens.weight") or name == "embed.weight") and not tied:
            continue
        if name.endswith("tid2eid"):
            continue
        total += param.numel() * param.element_size()
    return total
