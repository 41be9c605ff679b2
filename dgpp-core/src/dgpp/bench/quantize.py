"""Quantized copies of a benchmark model (``dgpp bench --quant``), built on the device without a checkpoint.

A format name picks the ``quantization_config`` a shipped checkpoint of that format carries. The quantized
model is then built exactly as the Qwen loader builds one (``quantize_modules`` gives each decoder-layer
linear its packed parameters, ``load_weights`` fills every parameter through its ``weight_loader``), except
that the tensors come from :class:`EncodingReader`, which encodes each linear of the dense source model on
the device when its first packed tensor is asked for. Embedding, norms and lm_head stay dense, as shipped
checkpoints keep them. :func:`sync_hf_weights` then gives transformers the decoded values, so the HF
baseline runs the very weights dgpp serves.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dgpp.bench.step_bytes import quantized_linears
from dgpp.checkpoint.loader import load_weights
from dgpp.errors import ConfigError
from dgpp.nn.moe import FusedExperts
from dgpp.quant.apply import quantize_modules
from dgpp.quant.encode import encode
from dgpp.quant.format import QuantFormat
from dgpp.quant.scheme import KEY
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


def parse_variants(text: str) -> list[str]:
    """``--quant`` value -> the weight variants to benchmark in order (empty: the dense model alone)."""
    names = [v.strip() for v in text.split(",") if v.strip()] or [DENSE]
    unknown = [v for v in names if v != DENSE and v not in QUANT_CONFIGS]
    if unknown:
        raise ConfigError(
            f"--quant: unknown format(s) {unknown}; known: {', '.join([DENSE, *QUANT_CONFIGS])}"
        )
    return list(dict.fromkeys(names))


class EncodingReader:
    """A ``CheckpointReader`` stand-in over in-memory dense tensors (HF names): a quantized module's stored
    tensors are encoded from its dense ``.weight`` on the source's device, one module at a time (the last
    encoding is kept until another module is asked for, so 8B shapes never hold more than one in fp32)."""

    def __init__(self, dense: dict[str, torch.Tensor], formats: dict[str, QuantFormat], label: str) -> None:
        self.dense = dense
        self.formats = formats  # module name -> its format
        self.dir = f"<{label} encoded in memory>"
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def _split(self, name: str) -> tuple[str, str]:
        module, _, suffix = name.rpartition(".")
        return module, suffix

    def _encoded(self, module: str) -> dict[str, torch.Tensor]:
        if self._cached is None or self._cached[0] != module:
            self._cached = None  # free the previous module's tensors first
            weight = self.dense[f"{module}.weight"]
            self._cached = (module, encode(self.formats[module], weight.float()))
        return self._cached[1]

    def names(self) -> list[str]:
        out = [n for n in self.dense if self._split(n)[0] not in self.formats]
        for module, fmt in self.formats.items():
            shape = tuple(self.dense[f"{module}.weight"].shape)
            out += [f"{module}.{suffix}" for suffix in fmt.tensor_shapes(shape)]
        return sorted(out)

    def __contains__(self, name: str) -> bool:
        module, suffix = self._split(name)
        if module in self.formats:
            shape = tuple(self.dense[f"{module}.weight"].shape)
            return suffix in self.formats[module].tensor_shapes(shape)
        return name in self.dense

    def where(self, name: str) -> str:
        return self.dir

    def searched(self) -> str:
        return self.dir

    def get(self, name: str) -> torch.Tensor:
        module, suffix = self._split(name)
        if module in self.formats:
            return self._encoded(module)[suffix]
        return self.dense[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def get_part(self, name: str, dim: int, start: int, length: int) -> torch.Tensor:
        return self.get(name).narrow(dim, start, length)


@torch.inference_mode()
def quantize_model(source: Model, raw_config: dict[str, Any], fmt_name: str) -> Model:
    """A new model in ``fmt_name`` whose decoder-layer linears hold ``source``'s weights encoded (on the
    source's device); everything else is a copy of ``source``'s dense tensors."""
    from dgpp.bench.models import new_model

    if fmt_name not in QUANT_CONFIGS:
        raise ConfigError(f"--quant: unknown format {fmt_name!r}; known: {', '.join(QUANT_CONFIGS)}")
    if any(isinstance(m, FusedExperts) for m in source.modules()):
        # the source holds experts stacked, a checkpoint names them one by one: not mapped here yet
        raise ConfigError(
            f"--quant {fmt_name}: MoE geometries are not supported (dense and hybrid geometries are)"
        )
    config = {**raw_config, KEY: QUANT_CONFIGS[fmt_name]}
    device = next(source.parameters()).device
    model = new_model(config, device)
    # the loader's own path: packed parameters first, then every tensor through its weight_loader; the
    # packed parameters are created on the model's device, inside the device context as the Qwen loader does
    with torch.device(device):
        quantize_modules(model, config)
    formats = {name: layer.quant_method.fmt for name, layer in quantized_linears(model).items()}
    stray = [name for name in formats if not name.startswith("model.layers.")]
    if stray:
        raise RuntimeError(f"--quant {fmt_name}: modules outside the decoder layers were quantized: {stray}")
    load_weights(model, EncodingReader(dict(source.named_parameters()), formats, fmt_name))
    return model.eval()


def shares_storage(a: nn.Module, b: nn.Module) -> bool:
    """Whether any parameter of ``a`` is a tensor of ``b`` (``build_pair`` shares them when two copies do not fit)."""
    ptrs = {p.data_ptr() for p in b.parameters()}
    return any(p.data_ptr() in ptrs for p in a.parameters())


@torch.inference_mode()
def sync_hf_weights(hf: nn.Module, model: Model) -> None:
    """Copy ``model``'s weights into the transformers model (same names): quantized linears decoded to
    the HF parameter's dtype, so both compute with the same values."""
    hf_params = dict(hf.named_parameters())
    packed = quantized_linears(model)
    for name, layer in packed.items():
        target = hf_params[f"{name}.weight"]
        target.copy_(layer.quant_method.dense_weight(layer, target.dtype))
    for name, param in model.named_parameters():
        module = name.rpartition(".")[0]
        if module in packed:
            continue
        if name not in hf_params:
            raise KeyError(f"transformers model has no parameter {name}")
        hf_params[name].copy_(param)


@torch.inference_mode()
def compare_with_torch_path(
    model: Model, batch: int = 4, prompt: int = 32, seed: int = 1
) -> dict[str, float]:
    """The quantized model through its kernels against the same model through the torch decode path
    (the policy's ``quant_torch_only``, ``DGPP_QUANT_TORCH=1``: weights decoded to the compute dtype, then ``F.linear``): one prefill (the
    GEMM path) and one decode step (the GEMV path) on random prompts, both fed the reference's tokens.
    Returns the largest |difference| over the largest |reference logit| and the argmax agreement of each."""
    from dgpp.bench.decode import DecodeSession, random_prompts
    from dgpp.engine.work import SeqWork
    from dgpp.policy import overriding

    prompts = random_prompts(batch, prompt, model.info.vocab_size, seed)
    logits: dict[str, list[torch.Tensor]] = {}
    first: list[int] = []
    for path, torch_only in (("torch", True), ("kernels", False)):
        with overriding(quant_torch_only=torch_only):
            session = DecodeSession(model, batch, prompt + 2, 16, graph=False)
            work = [SeqWork(b, session.tables[b], 0, p) for b, p in enumerate(prompts)]
            pre = session.runner.step(work).float()
            first = first or pre.argmax(-1).tolist()
            work = [SeqWork(b, session.tables[b], prompt, [first[b]]) for b in range(batch)]
            logits[path] = [pre, session.runner.step(work).float()]
    out: dict[str, float] = {}
    for i, phase in enumerate(("prefill", "decode")):
        ref, got = logits["torch"][i], logits["kernels"][i]
        out[f"{phase}_rel_diff"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        out[f"{phase}_argmax_agree"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return out
