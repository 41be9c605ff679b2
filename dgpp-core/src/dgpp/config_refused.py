"""Template keys of the original engine (github.com/HawkBearPig/dgpp) that this engine does not build.

A template written for the original engine may carry them. Accepting them would promise behaviour that does not
run, and calling them unknown would hide why, so each is refused by its path with the reason. A key returns to
the schema (``dgpp.config_schema``) together with its feature.
"""

from __future__ import annotations

from typing import Any

_FOLDED = (
    "the exact chain already multiplies each group's scale into the decoded weight values before the product "
    "(the folded form this lever selects), so there is nothing for it to change"
)

# path -> why it is refused, whatever its value
NOT_BUILT_KEYS: dict[tuple[str, ...], str] = {
    ("ssh_user",): "peers are not started over ssh: `dgpp launch` starts the local ranks on each node",
    ("release",): "installed releases are not built: dgpp runs the packages installed in its environment",
    (
        "paths",
    ): "dgpp logs to stderr, stages no files and keeps no resident weight images, so it has no paths",
    ("ports", "metrics"): "a per-peer metrics listener is not built: /metrics and /metrics/prometheus are "
    "served on http.port",
    ("engine", "rope_scaling", "mrope_cache_factor"): "multimodal RoPE is not built (text models only)",
    ("engine", "mtp_draft"): "a draft is always the drafter's argmax (what verification keeps exact)",
    (
        "engine",
        "mtp_draft_temperature",
    ): "a draft is always the drafter's argmax (what verification keeps exact)",
    ("engine", "mtp_expert_format"): "the drafter's experts are kept in the checkpoint's own format",
    ("engine", "prefill_group"): "not a switch here: co-arriving prompts always share a forward within "
    "engine.prefill_budget_tokens",
    ("engine", "sampling_candidates"): "the sampler reads the whole vocabulary row (no candidate table)",
    (
        "engine",
        "graph_batch_min_live",
    ): "decode graphs batch every decode-only step (there are no per-slot graphs)",
    ("engine", "fp8_head"): "the vocabulary head runs as a GEMV (no FP8 MMA head kernel)",
    ("engine", "prefill_fold_scales"): _FOLDED,
    ("engine", "prefill_fp8_per_tensor"): "the per-tensor FP8 prefill recipe is not built (block-scaled "
    "weights take engine.prefill_fp8_gemm)",
}

# path -> {value: why it is refused}: the key is built, these values of it are not
NOT_BUILT_VALUES: dict[tuple[str, ...], dict[Any, str]] = {}


def _lookup(raw: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    node: Any = raw
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def not_built(raw: dict[str, Any]) -> list[str]:
    """One problem per key (or value) of ``raw`` that this engine does not build, naming its path and why."""
    problems = []
    for path, why in NOT_BUILT_KEYS.items():
        if _lookup(raw, path)[0]:
            problems.append(f"{'.'.join(path)}: not built in this engine ({why}); remove the key")
    for path, values in NOT_BUILT_VALUES.items():
        found, value = _lookup(raw, path)
        if found and isinstance(value, str) and value in values:
            problems.append(f"{'.'.join(path)}: {value!r} is not built in this engine ({values[value]})")
    return problems
