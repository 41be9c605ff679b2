"""Assemble a ``ServingEngine`` from a deployment: checkpoint, tokenizer, template, model, pools, scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from dgpp.engine.work import StepRunner
from dgpp.sample.params import SamplingDefaults
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.config import SchedulerConfig
from dgpp.sched.engine_loop import EngineLoop
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.scheduler import Scheduler
from dgpp.serve.backend import ModelLimits, ServingEngine
from dgpp.serve.engine_keys import check_engine_keys
from dgpp.serve.metrics import scheduler_snapshot

log = structlog.get_logger("dgpp.serve")
MAX_SNAPSHOT_SLOTS = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def snapshot_slots(engine_cfg: Any, state_bytes_per_request: int) -> int:
    """Prefix-cache snapshot slots: ``min(4096, floor(prefix_cache_gib · 2^30 / snapshot bytes))``."""
    gib = float(getattr(engine_cfg, "prefix_cache_gib", 1.5))
    if gib <= 0 or state_bytes_per_request <= 0:
        return 0
    return min(MAX_SNAPSHOT_SLOTS, int(gib * 2**30 // state_bytes_per_request))


def assemble(
    model_id: str,
    engine_cfg: Any,
    runner: StepRunner,
    *,
    vocab_size: int,
    max_position: int,
    num_blocks: int,
    block_size: int,
    hybrid: bool,
    copy_state: Any,
    num_snapshot_slots: int,
    eos_token_ids: frozenset[int],
    snapshot_bytes: int = 0,
    defaults: SamplingDefaults,
    text: TextStack,
    start_loop: bool = True,
    speculative: Any = None,
) -> ServingEngine:
    """Wire pools, prefix cache, scheduler and engine thread around ``runner``; starts the engine thread
    unless ``start_loop`` is false (a TP peer drives the scheduler from the journal instead)."""
    sched_cfg = SchedulerConfig.from_engine(engine_cfg, block_size, max_position)
    blocks = BlockPool(num_blocks, block_size)
    slots = SlotPool(sched_cfg.max_concurrency, num_snapshot_slots if hybrid else 0)
    enabled = sched_cfg.prefix_cache and (num_snapshot_slots > 0 or not hybrid)
    cache = PrefixCache(blocks, sched_cfg.chunk_tokens, hybrid=hybrid, slots=slots, copy_state=copy_state,
                        min_tokens=sched_cfg.prefix_min_tokens, enabled=enabled, snapshot_bytes=snapshot_bytes)
    scheduler = Scheduler(sched_cfg, runner, blocks, slots, cache, eos_token_ids)
    scheduler.speculative = speculative  # engine.mtp (None: plain decode)
    loop = EngineLoop(scheduler, float(getattr(engine_cfg, "stats_interval_s", 10.0)), snapshot=scheduler_snapshot,
                      gather_ms=float(getattr(engine_cfg, "admission_gather_ms", 0)))
    if start_loop:
        loop.start()
    limits = ModelLimits(vocab_size=vocab_size, max_position=max_position, kv_pool_tokens=num_blocks * block_size)
    log.info("engine ready", model=model_id, kv_blocks=num_blocks, block_size=block_size,
             chunk_tokens=sched_cfg.chunk_tokens, prefix_cache=enabled, snapshot_slots=slots.num_snapshots)
    return ServingEngine(model_id, text.tokenizer, text.template, loop, limits, defaults,
                         default_max_tokens=int(getattr(engine_cfg, "default_max_tokens", 256)),
                         eos_token_ids=eos_token_ids, dialect=text.dialect, grammar=text.grammar,
                         reasoning_in_content=bool(getattr(engine_cfg, "reasoning_in_content", False)))


@dataclass
class TextStack:
    """The checkpoint's text side: tokenizer, chat template, tool/reasoning dialect, grammar context."""

    tokenizer: Any
    template: Any = None
    dialect: Any = None
    grammar: Any = None


def _text_stack(checkpoint: Path, vocab_size: int | None = None, family: str | None = None,
                hf_config: dict | None = None, pm: Any = None) -> TextStack:
    from dgpp.text.chat_template import ChatTemplate
    from dgpp.text.errors import TemplateError
    from dgpp.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(checkpoint)
    dialect = None
    if pm is not None and family is not None:
        dialect = pm.hook.dgpp_tool_dialect(family=family, hf_config=hf_config or {})
    try:
        template = ChatTemplate.for_checkpoint(tokenizer, family, hf_config, pm,
                                               effort=getattr(dialect, "effort", None))
    except TemplateError as e:
        log.warning("no chat template: /v1/chat/completions will answer 400", reason=e.message)
        template = None
    grammar = None
    try:
        from dgpp.text.grammar import GrammarContext

        grammar = GrammarContext(tokenizer, vocab_size)
    except Exception as e:  # constrained decoding is optional: requests that need it get a clear 400
        log.warning("constrained decoding unavailable", reason=f"{type(e).__name__}: {e}")
    return TextStack(tokenizer, template, dialect, grammar)


def _install_policy(engine_cfg: Any) -> None:
    """Fix this engine's execution policy for its life (``dgpp.policy``): batch invariance and the packed decode
    GEMV, whose "auto" resolves from the most rows a step can hold (a row's bits must not depend on server load)."""
    from dgpp.policy import ExecPolicy, install

    depth = int(getattr(engine_cfg, "mtp_depth", 1)) if getattr(engine_cfg, "mtp", False) else 0
    max_rows = int(getattr(engine_cfg, "max_concurrency", 1)) * (1 + depth)
    setting = str(getattr(engine_cfg, "quant_decode_gemv", "auto"))
    policy = ExecPolicy.for_engine(batch_invariant=bool(getattr(engine_cfg, "batch_invariant", False)),
                                   quant_decode_gemv=setting, decode_max_rows=max_rows)
    install(policy)
    log.info("packed decode GEMV", setting=setting, max_rows_per_step=max_rows)


def build_serving_engine(cfg: Any, *, world: Any = None, group: Any = None, device: str | None = None,
                         start_loop: bool = True) -> ServingEngine:
    """The real thing: load the checkpoint named by ``cfg.model`` through its family plugin (this rank's
    slice of it under tensor parallelism: ``world``, ``group`` and ``device`` come from ``dgpp.dist``)."""
    from dgpp.checkpoint.resolve import resolve_checkpoint
    from dgpp.engine.loading import load_model, read_hf_config
    from dgpp.engine.runner import ModelRunner
    from dgpp.plugins import manager, resolve
    from dgpp.step.pools import CachePools

    engine_cfg = cfg.engine
    checkpoint = resolve_checkpoint(cfg.model)
    pm = manager()
    hf_config = read_hf_config(checkpoint)
    family = resolve(pm, hf_config).family.name
    check_engine_keys(engine_cfg)  # before any weight is read
    dtype = _DTYPES.get(str(getattr(engine_cfg, "dtype", "auto")))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    _install_policy(engine_cfg)  # engine-wide row routing on CUDA, the packed decode GEMV
    model = load_model(checkpoint, engine_cfg, dtype=dtype, device=device, pm=pm, world=world, group=group)
    info = model.info
    check_engine_keys(engine_cfg, info.dtype)  # kv_dtype "bf16" must match the model's compute dtype
    text = _text_stack(checkpoint, info.vocab_size, family, hf_config, pm)
    tokenizer = text.tokenizer
    block_size = int(getattr(engine_cfg, "block_size", 16))
    num_blocks = -(-int(engine_cfg.kv_capacity) // block_size)
    spec = model.cache_spec()
    state_bytes = sum(s.bytes_per_request() for s in spec.values() if hasattr(s, "bytes_per_request"))
    n_snap = snapshot_slots(engine_cfg, state_bytes) if info.hybrid else 0
    pools = CachePools(spec, num_blocks, block_size, int(engine_cfg.max_concurrency) + n_snap, device=device)
    runner = ModelRunner(
        model, pools, decode_graph=bool(getattr(engine_cfg, "decode_graph", False)),
        max_batch=int(engine_cfg.max_concurrency), max_blocks=min(num_blocks, -(-info.max_position // block_size)),
    )
    from dgpp.engine.speculative_build import build_speculative

    speculative = build_speculative(engine_cfg, checkpoint, runner, pm=pm, dtype=dtype, device=device, world=world,
                                    group=group)
    eos = frozenset(info.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    return assemble(
        engine_cfg.model_alias or cfg.model, engine_cfg, runner,
        vocab_size=info.vocab_size, max_position=info.max_position, num_blocks=num_blocks, block_size=block_size,
        hybrid=info.hybrid, copy_state=pools.copy_state, num_snapshot_slots=n_snap, eos_token_ids=eos,
        snapshot_bytes=state_bytes,
        defaults=SamplingDefaults.from_generation_config(checkpoint), text=text, start_loop=start_loop,
        speculative=speculative,
    )


def build_toy_engine(model_id: str, tokenizer_dir: str | Path, engine_cfg: Any, *, hybrid: bool = False,
                     favour: dict[int, float] | None = None) -> ServingEngine:
    """A serving engine over ``ToyRunner`` (no checkpoint) for API-shape tests."""
    from dgpp.sched.toy_runner import ToyRunner

    text = _text_stack(Path(tokenizer_dir))
    tokenizer = text.tokenizer
    block_size = int(getattr(engine_cfg, "block_size", 16))
    num_blocks = -(-int(engine_cfg.kv_capacity) // block_size)
    n_snap = 16 if hybrid else 0
    runner = ToyRunner(tokenizer.vocab_size, num_blocks, block_size, int(engine_cfg.max_concurrency) + n_snap,
                       hybrid=hybrid, favour=favour)
    return assemble(
        model_id, engine_cfg, runner, vocab_size=tokenizer.vocab_size, max_position=4096,
        num_blocks=num_blocks, block_size=block_size, hybrid=hybrid, copy_state=runner.copy_state,
        num_snapshot_slots=n_snap, eos_token_ids=frozenset(tokenizer.eos_token_ids),
        defaults=SamplingDefaults.from_generation_config(tokenizer_dir), text=text,
    )
