"""A ``Backend`` over ``ToyRunner`` (no checkpoint), for API-shape and scheduler tests."""

from __future__ import annotations

from pathlib import Path

from dgpp.config import EngineConfig
from dgpp.sample.params import SamplingDefaults
from dgpp.serve.backend import Backend
from dgpp.server_assembly import PoolSizes, assemble_backend, load_text_stack
from dgpp.testing.toy_runner import ToyRunner

TOY_SNAPSHOT_SLOTS = 16  # hybrid mode: enough prefix-cache snapshots for the tests' prompts
TOY_MAX_POSITION = 4096


def build_toy_backend(
    model_id: str,
    tokenizer_dir: str | Path,
    engine_cfg: EngineConfig,
    *,
    hybrid: bool = False,
    favour: dict[int, float] | None = None,
) -> Backend:
    """The product's scheduler, prefix cache, step loop thread and HTTP-facing engine around a ``ToyRunner``."""
    text = load_text_stack(Path(tokenizer_dir))
    tokenizer = text.tokenizer
    sizes = PoolSizes.of(engine_cfg, TOY_SNAPSHOT_SLOTS if hybrid else 0)
    runner = ToyRunner(
        tokenizer.vocab_size,
        sizes.num_blocks,
        sizes.block_size,
        sizes.state_slots,
        hybrid=hybrid,
        favour=favour,
    )
    return assemble_backend(
        model_id,
        engine_cfg,
        runner,
        sizes=sizes,
        vocab_size=tokenizer.vocab_size,
        max_position=TOY_MAX_POSITION,
        hybrid=hybrid,
        copy_state=runner.copy_state,
        eos_token_ids=frozenset(tokenizer.eos_token_ids),
        defaults=SamplingDefaults.from_generation_config(tokenizer_dir),
        text=text,
    )
