"""The Qwen drafters behind ``dgpp_build_draft``: the multi-token-prediction (MTP) layer a checkpoint ships
under ``mtp.*`` (dropped by transformers when it loads the main model), for the Qwen3.5 hybrids
(``qwen3_5_mtp.py``) and Qwen3.8-Flash-Next (``qwen4_exp_mtp.py``); or, for the Qwen3.5 text models, the
DFlash2 block drafter of the checkpoint ``engine.dflash_model`` names (``dflash2.py``). Qwen3 / Qwen3-MoE have
none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from dgpp.plugin_api import (
    BlockDrafter,
    ConfigError,
    Drafter,
    LoadContext,
    checkpoint_tensor_names,
    load_family_weights,
)
from dgpp_qwen.config import MTP_PREFIX

M = TypeVar("M", bound=nn.Module)


def load_mtp_drafter(ctx: LoadContext, make: Callable[[], M]) -> M | None:
    """Build a drafter with ``make()`` on the load device and fill it from the checkpoint's ``mtp.*`` tensors
    (stored dense; the main model's head is shared, so no load-time conversion); None when the checkpoint has no
    ``mtp.fc.weight`` (any Qwen MTP layout with an input fc)."""
    if f"{MTP_PREFIX}fc.weight" not in checkpoint_tensor_names(ctx.checkpoint_dir):
        return None
    return load_family_weights(ctx, make, lambda name: MTP_PREFIX + name, packed=False, convert=False)


def build_draft(ctx: LoadContext, model: nn.Module) -> Drafter | BlockDrafter | None:
    """The drafter of a Qwen3.5 text model (the DFlash2 checkpoint of ``engine.dflash_model`` when it names one,
    else its MTP layer) or of a qwen4_exp checkpoint, weights loaded; None for other Qwen models or a checkpoint
    without an MTP layer."""
    from dgpp_qwen.qwen3_5 import Qwen35ForCausalLM
    from dgpp_qwen.qwen4_exp import Qwen4ExpForCausalLM

    if ctx.engine.dflash_model:
        if not isinstance(model, Qwen35ForCausalLM):
            raise ConfigError(
                f"engine.dflash_model: a DFlash2 drafter runs on the Qwen3.5 text models (qwen3_5), not {type(model).__name__}"
            )
        from dgpp_qwen.dflash2 import load_dflash2

        return load_dflash2(ctx, model)
    if isinstance(model, Qwen35ForCausalLM):
        from dgpp_qwen.qwen3_5_mtp import Qwen35MTPDrafter

        return load_mtp_drafter(ctx, lambda: Qwen35MTPDrafter(model))
    if isinstance(model, Qwen4ExpForCausalLM):
        from dgpp_qwen.qwen4_exp_mtp import Qwen4ExpMTPDrafter

        return load_mtp_drafter(ctx, lambda: Qwen4ExpMTPDrafter(model))
    return None
