"""MiMo-V2.6 (``MiMoV2ForCausalLM`` / ``mimo_v2``) served by the MiMo-V2-Flash model: the release's config is
rewritten into the ``mimo_v2_flash`` form (``dgpp_mimo.v26_config``), its tensors are read through
``V26Reader`` and its formats come from ``V26Scheme`` (``dgpp_mimo.v26_checkpoint``). Nothing is converted on
disk: the FP8 and MXFP4 bytes load as shipped. Also the MTP drafter (V2.6 ships one; transformers' flash layout
has none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dgpp.plugin_api import CheckpointError, LoadContext, Model, load_family_weights
from dgpp_mimo.config import MimoArchConfig
from dgpp_mimo.v26_checkpoint import V26Reader, V26Scheme
from dgpp_mimo.v26_config import canonical_config, projection_layout

if TYPE_CHECKING:
    from dgpp_mimo.draft import MimoMTPDrafter

MIMO_V2 = ("MiMoV2ForCausalLM", "mimo_v2")
FLASH_ARCHITECTURE = "MiMoV2FlashForCausalLM"


@dataclass(frozen=True)
class V26:
    """A V2.6 checkpoint's load context in the flash form: ``ctx`` carries the canonical config, ``quant`` the
    release's ``quantization_config`` (None: BF16), ``fused`` whether attention ships one ``qkv_proj``."""

    ctx: LoadContext
    cfg: MimoArchConfig
    quant: dict[str, Any] | None
    fused: bool
    mtp_layers: int

    @classmethod
    def of(cls, ctx: LoadContext) -> V26:
        canonical = canonical_config(ctx.hf_config)
        flash = dataclasses.replace(ctx, hf_config=canonical, architecture=FLASH_ARCHITECTURE)
        return cls(
            flash,
            MimoArchConfig.from_hf_config(canonical),
            ctx.hf_config.get("quantization_config"),
            projection_layout(ctx.hf_config) == "fused_qkv",
            int(ctx.hf_config.get("num_nextn_predict_layers") or 0),
        )

    def scheme(self, reader: V26Reader | None = None) -> V26Scheme:
        return V26Scheme(
            self.ctx.hf_config, self.quant, None if reader is None else reader.names(), self.fused
        )

    def loading(self) -> dict[str, Any]:
        """``load_family_weights``' reader and scheme for this checkpoint."""
        reader = V26Reader(self.ctx.checkpoint_dir, self.ctx.hf_config, self.quant, fused=self.fused)
        return {"reader": reader, "scheme": self.scheme(reader)}


def is_v26(ctx: LoadContext) -> bool:
    return ctx.architecture in MIMO_V2 or ctx.hf_config.get("model_type") == "mimo_v2"


def load_v26(ctx: LoadContext) -> Model:
    from dgpp_mimo.model import MimoV2FlashForCausalLM

    v26 = V26.of(ctx)
    return load_family_weights(
        v26.ctx,
        lambda: MimoV2FlashForCausalLM(v26.cfg, dtype=ctx.dtype, world=ctx.world, group=ctx.group),
        **v26.loading(),
    )


def build_draft(ctx: LoadContext, model: Model) -> MimoMTPDrafter | None:
    """The MTP drafter of a V2.6 checkpoint (``min(num_nextn_predict_layers, engine.mtp_depth)`` layers), or
    None for a checkpoint without MTP layers."""
    from dgpp_mimo.draft import load_drafter
    from dgpp_mimo.model import MimoV2FlashForCausalLM

    v26 = V26.of(ctx)
    if v26.mtp_layers == 0:
        return None
    loading = v26.loading()
    first = "model.mtp.layers.0.eh_proj.weight"
    if first not in loading["reader"]:
        loading["reader"].close()
        raise CheckpointError(
            f"config.json declares num_nextn_predict_layers={v26.mtp_layers} but tensor "
            f"{first!r} is missing from {ctx.checkpoint_dir}"
        )
    if not isinstance(
        model, MimoV2FlashForCausalLM
    ):  # load_v26 built it: the drafter shares its embedding and head
        raise TypeError(f"a MiMo-V2.6 drafter needs the MiMo model, got {type(model).__name__}")
    return load_drafter(v26.ctx, v26.cfg, model, min(v26.mtp_layers, ctx.engine.mtp_depth), **loading)
