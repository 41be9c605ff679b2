"""The composition root of a serving process: a deployment's model, text stack, pools, scheduler, step loop
and ``Backend``, each built once and handed to the next one's constructor (``build_backend``; ``assemble_backend``
wires everything around a runner, which is also how the tests build a backend around a stand-in runner)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from dgpp.config import DeployConfig, EngineConfig
from dgpp.engine.work import StepRunner
from dgpp.nn.second_core import usable_cores
from dgpp.policy import ExecPolicy, install
from dgpp.sample.params import SamplingDefaults
from dgpp.sched.block_pool import BlockPool, SlotPool
from dgpp.sched.config import SchedulerConfig
from dgpp.sched.prefix_cache import PrefixCache
from dgpp.sched.scheduler import Scheduler
from dgpp.sched.step_loop import StepLoop, TickJournal
from dgpp.serve.backend import Backend, TextStack
from dgpp.serve.generation import ModelLimits
from dgpp.serve.images import ImageInputs
from dgpp.startup.kv_format import refuse_unstored_kv
from dgpp.startup.prefill_levers import refuse_idle_prefill_levers
from dgpp.step.cache_spec import stored_as

if TYPE_CHECKING:
    from dgpp.startup.deployment import Deployment

log = structlog.get_logger("dgpp.serve")
MAX_SNAPSHOT_SLOTS = 4096


@dataclass(frozen=True)
class Rank0Wiring:
    """What rank 0 of a tensor-parallel world adds to its engine: ``journal_for(scheduler)`` records each tick
    for the peers before it runs (``dgpp.dist.journal.JournalWriter``); ``name_departures(runner, speculative)``
    returns both wrapped so that a step broken by a peer's death is reported by the peer's name."""

    journal_for: Callable[[Scheduler], TickJournal]
    name_departures: Callable[[Any, Any], tuple[Any, Any]]


def snapshot_slots(engine_cfg: EngineConfig, state_bytes_per_request: int) -> int:
    """Prefix-cache snapshot slots: ``min(4096, floor(prefix_cache_gib · 2^30 / snapshot bytes))``."""
    gib = engine_cfg.prefix_cache_gib
    if gib <= 0 or state_bytes_per_request <= 0:
        return 0
    return min(MAX_SNAPSHOT_SLOTS, int(gib * 2**30 // state_bytes_per_request))


@dataclass(frozen=True)
class PoolSizes:
    """The KV and state geometry, derived once from ``engine.*`` and handed to both sides that must agree on it:
    the tensors (``CachePools``) and the ids the scheduler hands out (``BlockPool``, ``SlotPool``)."""

    num_blocks: int
    block_size: int
    live_slots: int
    snapshot_slots: int

    @classmethod
    def of(cls, engine_cfg: EngineConfig, snapshot_slots: int = 0) -> PoolSizes:
        """``ceil(kv_capacity / block_size)`` blocks; one live state slot per concurrent request."""
        return cls(
            -(-engine_cfg.kv_capacity // engine_cfg.block_size),
            engine_cfg.block_size,
            engine_cfg.max_concurrency,
            snapshot_slots,
        )

    @property
    def state_slots(self) -> int:
        return self.live_slots + self.snapshot_slots

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size


def assemble_backend(
    model_id: str,
    engine_cfg: EngineConfig,
    runner: StepRunner,
    *,
    sizes: PoolSizes,
    vocab_size: int,
    max_position: int,
    hybrid: bool,
    copy_state: Any,
    eos_token_ids: frozenset[int],
    snapshot_bytes: int = 0,
    defaults: SamplingDefaults,
    text: TextStack,
    start_loop: bool = True,
    speculative: Any = None,
    chunking_exact: bool = False,
    overlap_steps: bool = False,
    rank0: Rank0Wiring | None = None,
) -> Backend:
    """Wire pools, prefix cache, scheduler and step loop thread around ``runner``; starts the step loop thread
    unless ``start_loop`` is false (a TP peer drives the scheduler from the journal instead; rank 0 starts it
    once the world is watched). ``rank0``: the tensor-parallel journal and peer naming. ``chunking_exact``:
    a prompt row's bits do not depend on how the prompt was chunked (``prefill_chunking_exact``), so the prefix
    cache attaches at any full KV block instead of only at chunk cuts. ``overlap_steps``: the engine's policy lets
    a decode step launch before the previous step's tokens are read (``ExecPolicy.overlap_steps``), taken when the
    runner can (``overlaps_decode``) and no speculative decoder runs."""
    sched_cfg = SchedulerConfig.from_engine(engine_cfg, sizes.block_size, max_position)
    blocks = BlockPool(sizes.num_blocks, sizes.block_size)
    slots = SlotPool(sizes.live_slots, sizes.snapshot_slots if hybrid else 0)
    enabled = sched_cfg.prefix_cache and (sizes.snapshot_slots > 0 or not hybrid)
    attach = sizes.block_size if chunking_exact and not hybrid else None
    cache = PrefixCache(
        blocks,
        sched_cfg.chunk_tokens,
        hybrid=hybrid,
        slots=slots,
        copy_state=copy_state,
        min_tokens=sched_cfg.prefix_min_tokens,
        enabled=enabled,
        snapshot_bytes=snapshot_bytes,
        attach=attach,
    )
    if rank0 is not None:
        runner, speculative = rank0.name_departures(runner, speculative)
    scheduler = Scheduler(
        sched_cfg,
        runner,
        blocks,
        slots,
        cache,
        eos_token_ids,
        speculative=speculative,  # engine.mtp (None: plain decode)
        overlap_events=True,  # a tick's events go out while the next step runs on the GPU
        # decode steps launched before the previous step's tokens are read (dgpp.sched.overlap): GPU runners only
        overlap_steps=(
            overlap_steps and speculative is None and bool(getattr(runner, "overlaps_decode", False))
        ),
    )
    loop = StepLoop(
        scheduler,
        engine_cfg.stats_interval_s,
        vocab_size=vocab_size,
        gather_ms=engine_cfg.admission_gather_ms,
        gather_max_ms=engine_cfg.admission_gather_max_ms,
        journal=rank0.journal_for(scheduler) if rank0 is not None else None,
    )
    if start_loop:
        loop.start()
    limits = ModelLimits(vocab_size=vocab_size, max_position=max_position, kv_pool_tokens=sizes.kv_tokens)
    log.info(
        "engine ready",
        model=model_id,
        kv_blocks=sizes.num_blocks,
        block_size=sizes.block_size,
        chunk_tokens=sched_cfg.chunk_tokens,
        prefix_cache=enabled,
        prefix_attach_tokens=cache.attach_every,
        snapshot_slots=slots.num_snapshots,
    )
    return Backend(
        model_id,
        text,
        loop,
        limits,
        defaults,
        default_max_tokens=engine_cfg.default_max_tokens,
        eos_token_ids=eos_token_ids,
        reasoning_in_content=engine_cfg.reasoning_in_content,
        images=ImageInputs.of(text.images, engine_cfg.images) if text.images is not None else None,
        compiles_kernels=_compiles_kernels(runner),
    )


def _compiles_kernels(runner: Any) -> bool:
    """Whether the engine's first steps compile kernels (a CUDA runner), so ``engine.warmup`` applies."""
    device = getattr(runner, "device", None)  # a stand-in runner has none
    return device is not None and torch.device(device).type == "cuda"


def load_text_stack(
    checkpoint: Path,
    vocab_size: int | None = None,
    family: str | None = None,
    hf_config: dict | None = None,
    pm: Any = None,
) -> TextStack:
    """Tokenizer, chat template, dialect and grammar context of ``checkpoint`` (the family's, when named)."""
    from dgpp.text.chat_template import ChatTemplate
    from dgpp.text.errors import TemplateError
    from dgpp.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(checkpoint)
    dialect = images = None
    if pm is not None and family is not None:
        dialect = pm.hook.dgpp_tool_dialect(family=family, hf_config=hf_config or {})
        images = pm.hook.dgpp_image_input(
            family=family, hf_config=hf_config or {}, checkpoint_dir=str(checkpoint)
        )
    try:
        template = ChatTemplate.for_checkpoint(
            tokenizer, family, hf_config, pm, effort=getattr(dialect, "effort", None)
        )
    except TemplateError as e:
        log.warning("no chat template: /v1/chat/completions will answer 400", reason=e.message)
        template = None
    grammar = None
    try:
        from dgpp.text.grammar import GrammarContext

        grammar = GrammarContext(tokenizer, vocab_size)
    except Exception as e:  # constrained decoding is optional: requests that need it get a clear 400
        log.warning("constrained decoding unavailable", reason=f"{type(e).__name__}: {e}")
    return TextStack(tokenizer, template, dialect, grammar, images)


def _install_policy(engine_cfg: EngineConfig) -> ExecPolicy:
    """Fix this engine's execution policy for its life (``dgpp.policy``): batch invariance and the packed decode
    GEMV, whose "auto" resolves from the most rows a step can hold (a row's bits must not depend on server load)."""
    max_rows = engine_cfg.max_concurrency * (1 + engine_cfg.drafts_per_step())
    setting = engine_cfg.quant_decode_gemv
    policy = ExecPolicy.for_engine(
        batch_invariant=engine_cfg.batch_invariant,
        quant_decode_gemv=setting,
        decode_max_rows=max_rows,
        prefill_bf16_partials=engine_cfg.prefill_bf16_partials,
        prefill_fp8_gemm=engine_cfg.prefill_fp8_gemm,
    )
    install(policy)
    log.info("packed decode GEMV", setting=setting, max_rows_per_step=max_rows)
    return policy


def prefill_chunking_exact(device: Any, engine_cfg: EngineConfig) -> bool:
    """Whether a prompt row's bits are the same however the prompt is chunked: on the CPU every row goes through
    row-wise products and per-row attention (``dgpp.nn.batch_invariant``, ``dgpp.nn.attention.attend``); on CUDA
    only under ``engine.batch_invariant`` (every row canonical), since the flash prefill kernel's tiles follow
    the chunk."""
    import torch

    return torch.device(device).type == "cpu" or engine_cfg.batch_invariant


def _set_cpu_threads(setting: int, world_size: int) -> None:
    """torch's intra-op threads for a CPU engine (``engine.cpu_threads``). The default leaves one core to the
    HTTP event loop and the tokenizer threads: a decode step is a chain of small products bound by memory,
    and with every core in the op pool a thread preempted by the server stalls each parallel region's
    barrier. Several CPU ranks on one host keep torch's own setting unless the key names one."""
    if setting == 0 and world_size > 1:
        return
    cores = usable_cores()
    threads = setting or max(1, cores - 1)
    torch.set_num_threads(threads)
    log.info("cpu threads", threads=threads, cores=cores, setting=setting)


def build_backend(
    cfg: DeployConfig,
    deployment: Deployment | None = None,
    *,
    world: Any = None,
    group: Any = None,
    device: str | None = None,
    start_loop: bool = True,
    rank0: Rank0Wiring | None = None,
) -> Backend:
    """The real thing: load the checkpoint named by ``cfg.model`` through its family plugin (this rank's
    slice of it under tensor parallelism: ``world``, ``group`` and ``device`` come from ``dgpp.dist``;
    ``rank0``: rank 0's journal and peer naming).

    ``deployment`` is preflight's resolution of the checkpoint, config.json and family (resolved here when
    the caller ran no preflight); the model and the drafter load from its context.
    """
    from dgpp.engine.runner import ModelRunner
    from dgpp.startup.deployment import resolve_deployment
    from dgpp.startup.loading import model_for
    from dgpp.step.pools import CachePools

    engine_cfg = cfg.engine
    deployment = deployment or resolve_deployment(cfg, device)
    ctx = deployment.for_rank(world, device, group)
    device = ctx.device
    policy = _install_policy(engine_cfg)  # engine-wide row routing on CUDA, the packed decode GEMV
    if torch.device(device or "cpu").type == "cpu":
        _set_cpu_threads(engine_cfg.cpu_threads, ctx.world.size)
    model = model_for(ctx, deployment.pm)
    info = model.info
    refuse_unstored_kv(engine_cfg, info.dtype)  # kv_dtype "bf16" must match the model's compute dtype
    refuse_idle_prefill_levers(engine_cfg, model)  # a lossy lever must have something to act on
    text = load_text_stack(
        deployment.checkpoint, info.vocab_size, ctx.family, deployment.hf_config, deployment.pm
    )
    tokenizer = text.tokenizer
    spec = stored_as(model.cache_spec(), engine_cfg.kv_dtype)  # e4m3 K/V rows under kv_dtype fp8
    state_bytes = sum(s.bytes_per_request() for s in spec.values() if hasattr(s, "bytes_per_request"))
    sizes = PoolSizes.of(engine_cfg, snapshot_slots(engine_cfg, state_bytes) if info.hybrid else 0)
    pools = CachePools(spec, sizes.num_blocks, sizes.block_size, sizes.state_slots, device=device)
    runner = ModelRunner(
        model,
        pools,
        decode_graph=engine_cfg.decode_graph,
        max_batch=engine_cfg.max_concurrency,
        max_blocks=min(sizes.num_blocks, -(-info.max_position // sizes.block_size)),
    )
    from dgpp.startup.speculative_build import build_speculative

    speculative = build_speculative(engine_cfg, ctx, runner, pm=deployment.pm)
    eos = frozenset(info.eos_token_ids) | frozenset(tokenizer.eos_token_ids)
    return assemble_backend(
        engine_cfg.model_alias or cfg.model,
        engine_cfg,
        runner,
        sizes=sizes,
        vocab_size=info.vocab_size,
        max_position=info.max_position,
        hybrid=info.hybrid,
        copy_state=pools.copy_state,
        eos_token_ids=eos,
        snapshot_bytes=state_bytes,
        defaults=SamplingDefaults.from_generation_config(deployment.checkpoint),
        text=text,
        start_loop=start_loop,
        speculative=speculative,
        chunking_exact=prefill_chunking_exact(device, engine_cfg),
        overlap_steps=policy.overlap_steps,
        rank0=rank0,
    )


def serve_deployment(cfg: DeployConfig, deployment: Deployment | None = None) -> None:
    """``dgpp serve`` of a one-rank world: build the backend from preflight's ``deployment`` and serve it until
    interrupted. A missing API key variable fails before the model loads."""
    from dgpp.serve.access import configured_key
    from dgpp.serve.app import run

    configured_key(cfg.http)
    run(cfg, build_backend(cfg, deployment))
