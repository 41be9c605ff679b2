"""The speculative decoder a deployment asks for: ``engine.mtp`` (the drafter from the family's ``dgpp_build_draft``
hook, wrapped in a ``SpeculativeDecoder``, or a ``BlockDraftDecoder`` for a block drafter) or ``engine.draft:
"lookup"`` (a ``LookupDecoder``, any model)."""

from __future__ import annotations

import pluggy

from dgpp.config_schema import EngineConfig
from dgpp.engine.block_draft import BlockDraftDecoder
from dgpp.engine.lookup_draft import LookupDecoder
from dgpp.engine.runner import ModelRunner
from dgpp.engine.speculative import SpeculativeDecoder, VerifyDecoder
from dgpp.engine.verify_schedule import ScheduleSettings
from dgpp.errors import ConfigError
from dgpp.family import LoadContext
from dgpp.log import get_logger
from dgpp.step.model import BlockDrafter

log = get_logger("dgpp.engine")

#: the most drafts an MTP drafter that chains its own output (one forward a draft) verifies per step
CHAINED_MAX_DEPTH = 5


def build_speculative(
    engine_cfg: EngineConfig, ctx: LoadContext, runner: ModelRunner, *, pm: pluggy.PluginManager
) -> VerifyDecoder | None:
    """None unless ``engine.mtp`` is on or ``engine.draft`` is "lookup"; then the decoder at ``engine.mtp_depth``
    (a ``ConfigError`` naming the key when the checkpoint has no drafter) or at ``engine.draft_depth``. ``ctx`` is
    the context the target model was loaded with."""
    graphs_on = runner.graphs is not None
    if engine_cfg.draft == "lookup":
        lookup = LookupDecoder(
            runner,
            engine_cfg.draft_depth,
            engine_cfg.lookup_min_ngram,
            engine_cfg.lookup_ngram,
            _schedule(engine_cfg),
        )
        log.info(
            "speculative decoding on", drafter="lookup", depth=lookup.depth, ngram=engine_cfg.lookup_ngram
        )
        _say_graphs(graphs_on, runner)
        return lookup
    if not engine_cfg.mtp:
        return None
    model = runner.model
    checkpoint = ctx.checkpoint_dir
    drafter = pm.hook.dgpp_build_draft(ctx=ctx, model=model)
    if drafter is None:
        raise ConfigError(
            f"engine.mtp: true but {checkpoint} has no MTP drafter ({ctx.family} plugin's dgpp_build_draft "
            "returned None); set engine.mtp to false"
        )
    decoder: VerifyDecoder
    if isinstance(drafter, BlockDrafter):
        if engine_cfg.mtp_depth > drafter.drafts:
            raise ConfigError(
                f"engine.mtp_depth: {engine_cfg.mtp_depth} exceeds the {drafter.drafts} drafts a block of "
                f"{type(drafter).__name__} proposes; set engine.mtp_depth to at most {drafter.drafts}"
            )
        decoder = BlockDraftDecoder(runner, drafter, engine_cfg.mtp_depth, _schedule(engine_cfg))
    else:
        if engine_cfg.mtp_depth > CHAINED_MAX_DEPTH:
            raise ConfigError(
                f"engine.mtp_depth: {engine_cfg.mtp_depth} exceeds {CHAINED_MAX_DEPTH}, the most drafts "
                f"{type(drafter).__name__} chains (a block drafter proposes more); set engine.mtp_depth to at "
                f"most {CHAINED_MAX_DEPTH}"
            )
        decoder = SpeculativeDecoder(
            runner,
            drafter,
            engine_cfg.mtp_depth,
            kv_dtype=engine_cfg.kv_dtype,
            schedule=_schedule(engine_cfg),
        )
    log.info("speculative decoding on", drafter=type(drafter).__name__, depth=decoder.depth)
    _say_graphs(graphs_on, runner)
    return decoder


def _say_graphs(graphs_on: bool, runner: ModelRunner) -> None:
    """Log whether verify steps replay the decode graphs (``dgpp.engine.verify_graphs``) now that the decoder is
    built: they do unless the model's verify rows share per-request state."""
    if runner.graphs is not None:
        log.info("verify steps replay the decode graphs", rows=runner.graphs.max_batch)
    elif graphs_on:
        log.info(
            "engine.decode_graph has no effect with speculative decoding on this model: its verify rows share "
            "per-request state (recurrent, compressed or window entries), so every decode step runs eager"
        )


def _schedule(engine_cfg: EngineConfig) -> ScheduleSettings | None:
    """``engine.mtp_schedule``'s settings, or None when every proposed draft is verified."""
    return ScheduleSettings.from_engine(engine_cfg) if engine_cfg.mtp_schedule else None
