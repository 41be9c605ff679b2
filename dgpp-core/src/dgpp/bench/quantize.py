"""Quantized copies of a benchmark model (``dgpp bench --quant``), built on the device without a checkpoint.

A format name picks the ``quantization_config`` a shipped checkpoint of that format carries; ``EXPERTS+LINEARS``
(``mxfp4+fp8_block``) puts the routed experts in one format and the other decoder-layer linears in another, as
the MoE releases mix them; ``release`` is the ``quantization_config`` the geometry's release ships (Flint's FP8 and
NVFP4 experts per layer and projection, DeepSeek-V4's E8M0 scales). The geometry's ``PackedRelease`` (from its
plugin) gives the checkpoint names the family's loader asks for and the modules its releases keep dense. The
quantized model is then built as the loaders build one (``quantize_modules`` gives each packed linear and expert
stack its packed parameters, ``load_weights`` fills every parameter through its ``weight_loader``), except that
the tensors come from
``dgpp.bench.encoding_reader.EncodingReader``, which encodes each weight of the dense source model on the device
when it is first asked for (a routed expert from its slice of the source's stacked experts, under the per-expert
names releases ship). Embedding, norms and lm_head stay dense, as shipped checkpoints keep them.
:func:`sync_hf_weights` then gives transformers the decoded values, so the HF baseline runs the very weights
dgpp serves.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch
from torch import nn

from dgpp.bench.encoding_reader import EncodingReader, packed_sources, unpacked_parameters
from dgpp.bench.step_bytes import packed_experts, quantized_linears
from dgpp.checkpoint.loader import load_weights
from dgpp.errors import ConfigError
from dgpp.offers import PackedRelease
from dgpp.quant.apply import quantize_modules
from dgpp.quant.moe import PROJECTIONS
from dgpp.quant.scheme import KEY, ROUTED_EXPERT, QuantScheme
from dgpp.startup.weights import settle_weights
from dgpp.step.model import Model

DENSE = "bf16"  # the unquantized model in a ``--quant`` list (the compute dtype: fp32 on CPU)
_KEEP_DENSE = ["lm_head"]  # the embedding is no Linear, so the scheme never reaches it

# quantization_config of a released checkpoint in each format (the keys dgpp.quant.scheme parses)
QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    # DeepSeek-V3 / Qwen3-FP8: E4M3 with an F32 weight_scale_inv per 128x128 tile
    "fp8_block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": _KEEP_DENSE,
    },
    # compressed-tensors FP8 per output channel (weight_scale [N, 1])
    "fp8_channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": _KEEP_DENSE,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True},
            }
        },
    },
    # NVIDIA ModelOpt NVFP4: E2M1 pairs, E4M3 scale per 16, F32 weight_scale_2
    "nvfp4": {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "exclude_modules": _KEEP_DENSE,
    },
    # OCP MXFP4 (compressed-tensors mxfp4-pack-quantized): E2M1 pairs, E8M0 scale per 32
    "mxfp4": {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "ignore": _KEEP_DENSE,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "type": "float",
                    "num_bits": 4,
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                },
            }
        },
    },
}


# mixed formats one released quantization_config carries: FP8 E4M3 per 128 x 128 block with the routed experts
# in MXFP4 (E2M1 pairs, an E8M0 scale per 32 inputs, ``weight`` + ``weight_scale``), as DeepSeek-V4-Flash and
# MiMo-V2.6-Flash ship them
MIXED_CONFIGS: dict[str, dict[str, Any]] = {
    "mxfp4+fp8_block": {**QUANT_CONFIGS["fp8_block"], "expert_dtype": "fp4"},
}
RELEASE = "release"  # the quantization_config the geometry's release ships (``PackedRelease``)
SPEC_HELP = (
    f"{DENSE}, {', '.join(QUANT_CONFIGS)}, EXPERTS+LINEARS (routed experts in one format, the other "
    f"decoder-layer linears in another or {DENSE}, e.g. mxfp4+fp8_block, nvfp4+{DENSE}), or {RELEASE} (the "
    "geometry's release layout)"
)


def split_spec(spec: str) -> tuple[str, str]:
    """A ``--quant`` format -> (routed experts' format, other decoder-layer linears' format): ``F`` is ``F`` for
    both, ``E+L`` mixes them (``L`` may be ``bf16``: left dense). An unknown name is a ConfigError."""
    experts, plus, linears = spec.partition("+")
    linears = linears if plus else experts
    if experts not in QUANT_CONFIGS or linears not in (*QUANT_CONFIGS, DENSE):
        raise ConfigError(f"--quant: unknown format {spec!r}; known: {SPEC_HELP}")
    return experts, linears


def parse_variants(text: str) -> list[str]:
    """``--quant`` value -> the weight variants to benchmark in order (empty: the dense model alone)."""
    names = [v.strip() for v in text.split(",") if v.strip()] or [DENSE]
    unknown = []
    for name in names:
        try:
            if name not in (DENSE, RELEASE):
                split_spec(name)
        except ConfigError:
            unknown.append(name)
    if unknown:
        raise ConfigError(f"--quant: unknown format(s) {unknown}; known: {SPEC_HELP}")
    return list(dict.fromkeys(names))


def _scheme_of(quantization_config: dict[str, Any]) -> QuantScheme:
    scheme = QuantScheme.from_hf_config({KEY: quantization_config})
    assert scheme is not None  # every config here names a quant_method
    return scheme


def release_scheme(spec: str, release: PackedRelease) -> QuantScheme:
    """Which format each module of a geometry's ``spec`` release is in (checkpoint names): routed experts in the
    experts' format, the other decoder-layer linears in the linears' format, except what ``release`` keeps
    dense and lm_head; ``release`` spec: the release's own ``quantization_config``."""
    if spec == RELEASE:
        shipped = release.quantization_config
        if shipped is None:
            raise ConfigError(f"--quant {RELEASE}: this geometry names no release layout; known: {SPEC_HELP}")
        scheme = _scheme_of(dict(shipped))
        scheme.ignore += list(release.keep_dense)
        return scheme
    experts, linears = split_spec(spec)
    if spec in MIXED_CONFIGS:
        scheme = _scheme_of(MIXED_CONFIGS[spec])
    elif linears == DENSE:
        scheme = QuantScheme(DENSE, ignore=list(_KEEP_DENSE))
    else:
        scheme = _scheme_of(QUANT_CONFIGS[linears])
    if experts != linears and spec not in MIXED_CONFIGS:
        expert_format = _scheme_of(QUANT_CONFIGS[experts]).groups[0][1]
        scheme.overrides.insert(0, (ROUTED_EXPERT, expert_format))
    scheme.ignore += list(release.keep_dense)
    return scheme


DECODER_LAYER = re.compile(r"(.*\.)?layers\.\d+\.")  # what releases pack: decoder-layer modules


@torch.inference_mode()
def quantize_model(
    source: Model, raw_config: dict[str, Any], spec: str, release: PackedRelease | None = None
) -> Model:
    """A new model in ``spec`` (``split_spec``) whose decoder-layer linears and routed experts hold ``source``'s
    weights encoded (on the source's device), laid out as ``release`` says (names, modules kept dense); every
    other tensor is ``source``'s dense one. Built through the loader's own steps: the family's model,
    ``quantize_modules`` under the release's names, ``load_weights`` from an ``EncodingReader``, ``settle_weights``."""
    from dgpp.bench.models import new_model

    release = release or PackedRelease()
    scheme = release_scheme(spec, release)
    if quantized_linears(source) or packed_experts(source):
        raise ConfigError(
            f"--quant {spec}: the geometry's own random model is already packed in its release's formats "
            "(nothing dense to encode): run it without --quant"
        )
    device = next(source.parameters()).device
    # built on the host, where the dense tensors that packed ones replace (a 122B layer's expert stack is 4.8 GB)
    # are never touched and cost no memory; the packed parameters are created on the device, inside the device
    # context as the loaders do, and only what stays dense then moves there
    model = new_model(raw_config, "cpu")
    with torch.device(device):
        quantize_modules(model, raw_config, rename=release.checkpoint_name, scheme=scheme)
    model.to(device)
    source_params = dict(source.named_parameters())
    packed = packed_sources(model, source_params)
    stray = sorted({s.group for s in packed.values() if not DECODER_LAYER.match(s.group)})
    if stray:
        raise RuntimeError(f"--quant {spec}: modules outside the decoder layers were quantized: {stray}")
    if not packed:
        raise ConfigError(f"--quant {spec}: this geometry's releases pack none of its modules in that format")
    dense = {name: source_params[name] for name in unpacked_parameters(model)}
    reader = EncodingReader(dense, packed, release.checkpoint_name, spec)
    load_weights(model, reader, rename=release.checkpoint_name)
    return settle_weights(model).eval()


def shares_storage(a: nn.Module, b: nn.Module) -> bool:
    """Whether any parameter of ``a`` is a tensor of ``b`` (``build_pair`` shares them when two copies do not fit)."""
    ptrs = {p.data_ptr() for p in b.parameters()}
    return any(p.data_ptr() in ptrs for p in a.parameters())


@torch.inference_mode()
def sync_hf_weights(hf: nn.Module, model: Model) -> None:
    """Copy ``model``'s weights into the transformers model (same names): quantized linears and packed experts
    decoded to the HF parameter's dtype (experts into transformers' stacked ``gate_up_proj`` / ``down_proj``),
    so both compute with the same values."""
    hf_params = dict(hf.named_parameters())

    def target(name: str) -> torch.Tensor:
        if name not in hf_params:
            raise KeyError(f"transformers model has no parameter {name}")
        return hf_params[name]

    packed = quantized_linears(model)
    for name, layer in packed.items():
        weight = target(f"{name}.weight")
        weight.copy_(layer.quant_method.dense_weight(layer, weight.dtype))
    experts = packed_experts(model)
    for name, stack in experts.items():
        gate_up, down = target(f"{name}.gate_up_proj"), target(f"{name}.down_proj")
        for e in range(stack.num_experts):
            decoded = {proj: stack.expert_weight(proj, e, gate_up.dtype) for proj in PROJECTIONS}
            gate_up[e].copy_(torch.cat([decoded["gate_proj"], decoded["up_proj"]]))
            down[e].copy_(decoded["down_proj"])
    for name, param in unpacked_parameters(model).items():
        target(name).copy_(param)


class ModuleErrors:
    """While entered, each packed module's output is compared with the torch decode path's on the same inputs
    (the module run again under ``quant_torch_only``): ``worst`` holds the largest max |diff| / max |reference|
    and the module's name. A random model's logits can amplify rounding (routing flips, recurrent state), so this
    per-module error is what says whether a kernel computes its own product right."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [*quantized_linears(model).items(), *packed_experts(model).items()]
        self.worst: tuple[float, str] = (0.0, "")
        self._handles: list[Any] = []
        self._inside = False

    def _hook(self, name: str):
        from dgpp.policy import overriding

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            if self._inside or not isinstance(out, torch.Tensor):
                return
            self._inside = True
            try:
                with overriding(quant_torch_only=True):
                    ref = module(*args, **kwargs)
            finally:
                self._inside = False
            err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
            if err > self.worst[0]:  # all-equal modules leave the name empty
                self.worst = (err, name)

        return hook

    def __enter__(self) -> ModuleErrors:
        self._handles = [
            m.register_forward_hook(self._hook(name), with_kwargs=True) for name, m in self.modules
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.inference_mode()
def compare_with_torch_path(model: Model, batch: int = 4, prompt: int = 32, seed: int = 1) -> dict[str, Any]:
    """The quantized model through its kernels against the same model through the torch decode path
    (the policy's ``quant_torch_only``, ``DGPP_QUANT_TORCH=1``: weights decoded to the compute dtype, then
    ``F.linear``): one prefill (the GEMM path) and one decode step (the GEMV path) on random prompts, both fed
    the reference's tokens.
    Returns the largest |difference| over the largest |reference logit| and the argmax agreement of each, and
    the worst packed module's own error on the kernel path's inputs (``module_rel_diff``, ``module_worst``)."""
    from dgpp.bench.decode import DecodeSession, random_prompts
    from dgpp.engine.work import SeqWork
    from dgpp.policy import overriding

    prompts = random_prompts(batch, prompt, model.info.vocab_size, seed)
    logits: dict[str, list[torch.Tensor]] = {}
    first: list[int] = []
    errors = ModuleErrors(model)
    for path, torch_only in (("torch", True), ("kernels", False)):
        watch = contextlib.nullcontext() if torch_only else errors
        with overriding(quant_torch_only=torch_only), watch:
            session = DecodeSession(model, batch, prompt + 2, 16, graph=False)
            work = [SeqWork(b, session.tables[b], 0, p) for b, p in enumerate(prompts)]
            pre = session.runner.step(work).float()
            first = first or pre.argmax(-1).tolist()
            work = [SeqWork(b, session.tables[b], prompt, [first[b]]) for b in range(batch)]
            logits[path] = [pre, session.runner.step(work).float()]
    out: dict[str, Any] = {}
    for i, phase in enumerate(("prefill", "decode")):
        ref, got = logits["torch"][i], logits["kernels"][i]
        out[f"{phase}_rel_diff"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        out[f"{phase}_argmax_agree"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    out["module_rel_diff"], out["module_worst"] = errors.worst
    return out
