"""The deployment template's schema: msgspec Structs whose annotations are the keys, types, ranges and defaults.

Each key's default is written once, here; code that reads a setting reads it from these Structs (never
``getattr(cfg, key, default)``), and every key here is read by the engine. Loading, knobs and the rules between
keys are in ``dgpp.config`` and ``dgpp.config_checks``; the original engine's keys that are not built are refused
with their reason (``dgpp.config_refused``). Every key is documented in docs/configuration.md.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

_I64 = 2**63 - 1
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
#: the most drafts a verify step may judge per request; a drafter refuses a depth past what it proposes
MAX_DRAFT_DEPTH = 16
Depth = Annotated[int, msgspec.Meta(ge=1, le=MAX_DRAFT_DEPTH)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Common options: a misspelt key is an error, never silently ignored."""


class HttpConfig(_Section):
    """The OpenAI-compatible HTTP listener (rank 0 only)."""

    bind_host: str = "127.0.0.1"
    port: Port = 18080
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1, le=_I64)] = 16777216  # 16 MiB
    responses_store_bytes: Annotated[int, msgspec.Meta(ge=0, le=_I64)] = 67108864  # stored Responses, 64 MiB
    sse_ping_interval: Annotated[int, msgspec.Meta(ge=-1, le=86400)] = 30  # seconds; -1 disables; 0 refused
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = (
        30.0  # the whole request body must arrive within it
    )
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024, le=2**30)] = (
        65536  # request line + headers; more: 431
    )
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = (
        10.0  # request line + headers must arrive within it
    )
    allow_unknown_fields: bool = (
        False  # true: request fields this server does not know are ignored, not refused
    )
    api_key: str = (
        ""  # "" = no authentication; else every route but /health needs Authorization: Bearer <key>
    )
    api_key_env: str = ""  # the name of an environment variable holding the key (instead of api_key)
    cors_origins: list[Annotated[str, msgspec.Meta(min_length=1)]] = msgspec.field(default_factory=list)


class PortsConfig(_Section):
    """Ports every rank uses; ``http`` (when given) must agree with ``http.port``."""

    http: Port | None = None
    fabric: Port = 29970
    journal: Port = 29971


class RopeScaling(_Section, kw_only=True):
    """YaRN context extension: ``rope_type`` (or its old spelling ``type``) must be "yarn"."""

    rope_type: Literal["yarn"] | None = None
    type: Literal["yarn"] | None = None
    factor: Annotated[float, msgspec.Meta(ge=1.0)]
    original_max_position_embeddings: PosInt
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0


class ImagesConfig(_Section):
    """Limits on ``image_url`` parts of a request (models with a vision encoder): each is a 400 naming the part."""

    max_images: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8  # image parts per request
    max_image_bytes: Annotated[int, msgspec.Meta(ge=1, le=_I64)] = (
        20971520  # one image's decoded file, 20 MiB
    )
    # one image's width x height before the family resizes it (a bound on decoding memory), 7680 x 4320
    max_image_pixels: Annotated[int, msgspec.Meta(ge=1, le=2**40)] = 33177600


class EngineConfig(_Section):
    """Everything that changes what or how much the engine computes. Lossy levers default off."""

    # capacity and admission
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 8
    kv_capacity: Annotated[int, msgspec.Meta(ge=1, le=2**40)] = 8192
    # lossy at "fp8": K/V rows and MLA latents stored as e4m3 with one fp32 scale per row (dgpp.kernels.kv_fp8);
    # lossy at "fp4": MLA latents as e2m1 in 16-value blocks with e4m3 block scales (dgpp.kernels.latent_formats);
    # DSA index keys are e4m3 rows under either
    kv_dtype: Literal["auto", "bf16", "fp8", "fp4"] = "auto"
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    default_max_tokens: Annotated[int, msgspec.Meta(ge=1, le=2**30)] = 256
    queue_limit: PosInt = 64
    max_connections: PosInt = 64
    prefix_cache_gib: NonNegFloat = 1.5
    prefix_min_tokens: NonNegInt = 1024
    admission: Literal["full", "grow"] = "full"
    admission_window: PosInt = 256
    admission_gather_ms: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 3
    admission_gather_max_ms: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 0  # 0: no extension past gather_ms
    prefill_budget_tokens: Annotated[int, msgspec.Meta(ge=-1, le=2**30)] = -1
    prefill_idle_budget_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**30)] = 0
    model_alias: str = ""
    no_eos: bool = False
    reasoning_in_content: bool = False
    stats_interval_s: NonNegFloat = 10.0
    rendezvous_timeout_ms: PosInt = 120000
    # graphs and speculation
    decode_graph: bool = True  # CUDA-graph decode; the runner takes it only where CUDA graphs exist
    warmup: bool = True  # a CUDA engine runs its first step mixes before it listens (dgpp.serve.warmup)
    cpu_threads: NonNegInt = (
        0  # CPU engine: torch's intra-op threads; 0 -> one per core less one (at least 1)
    )
    mtp: bool = False
    mtp_depth: Depth = 1
    # a DFlash2 block drafter's checkpoint directory: engine.mtp drafts with it instead of the MTP layer (Qwen3.5)
    dflash_model: str = ""
    # confidence-scheduled verify depth for engine.mtp or engine.draft (dgpp.engine.verify_schedule)
    mtp_schedule: bool = False
    mtp_schedule_row_ms: Annotated[float, msgspec.Meta(gt=0)] = 8.0  # one verify row
    mtp_schedule_base_ms: NonNegFloat = 28.0  # a pass's fixed cost, the draft included
    mtp_schedule_lambda: NonNegFloat = 0.0  # the value of decode time, tokens/ms (0: a plain pass's rate)
    mtp_schedule_min_depth: Annotated[int, msgspec.Meta(ge=0, le=5)] = (
        1  # the fewest drafts a drafting request verifies
    )
    mtp_schedule_adapt: bool = True  # the value follows the modelled throughput, floored at the one above
    mtp_schedule_sampled_scale: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.93
    # prompt-lookup drafts for any model (dgpp.engine.lookup_draft); "off" or engine.mtp decodes without them
    draft: Literal["off", "lookup"] = "off"
    draft_depth: Depth = 3
    lookup_ngram: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3  # the longest suffix looked up
    lookup_min_ngram: Annotated[int, msgspec.Meta(ge=1, le=16)] = 2  # the shortest
    # weights and numerics
    bf16_weights: Literal["checkpoint", "bf12", "bf12+bf16"] = "checkpoint"
    dense_weights: Literal["checkpoint", "fp8"] = "checkpoint"
    # lossy: a converted GGUF's Q4_1 / Q4_0 / Q8_0 matrices multiplied packed on the CPU, in bf16 (dgpp.checkpoint.gguf_packed)
    gguf_weights: Literal["decoded", "int4pack"] = "decoded"
    quant_decode_gemv: Literal["auto", "row", "mma"] = (
        "auto"  # packed decode GEMV (dgpp.quant.kernels.decode_launch)
    )
    ngram_table: Literal["resident", "mmap"] = "resident"
    # DeepSeek-V4.1: the entries each indexer keeps per query (0: the checkpoint's index_topk)
    index_topk: Annotated[int, msgspec.Meta(ge=0, le=2048)] = 0
    # DeepSeek-V4.1: "bounded" runs the decoder layers over a prompt's last window only (lossy)
    prefill_mode: Literal["exact", "bounded"] = "exact"
    # lossy: prefill rows' packed expert down projections summed from bf16 partials (dgpp.quant.moe)
    prefill_bf16_partials: bool = False
    # lossy: prefill rows of FP8 block-scaled linears as an e4m3 x e4m3 GEMM (dgpp.quant.fp8_prefill)
    prefill_fp8_gemm: bool = False
    batch_invariant: bool = False  # every CUDA row through the fixed-order kernels (dgpp.nn.exact.routing)
    rope_scaling: RopeScaling | None = None
    images: ImagesConfig = msgspec.field(default_factory=ImagesConfig)

    def lossy_levers(self) -> list[str]:
        """The lossy keys turned on (logged at startup, carried by the digest)."""
        levers = (
            ["dense_weights"] if self.dense_weights == "fp8" else []
        )  # BF16 dense projections re-encoded to block FP8 at load
        if self.gguf_weights == "int4pack":  # bf16 block scales and bf16 products
            levers.append("gguf_weights")
        if self.prefill_mode == "bounded":  # the decoder layers skip all but a prompt's last window
            levers.append("prefill_mode")
        if self.kv_dtype in ("fp8", "fp4"):  # K/V, latent and index rows stored quantized, with row scales
            levers.append("kv_dtype")
        if self.prefill_bf16_partials:  # each expert's down-projection row rounded to bf16 before the sum
            levers.append("prefill_bf16_partials")
        if self.prefill_fp8_gemm:  # prefill activations quantized to e4m3 per token and 128 columns
            levers.append("prefill_fp8_gemm")
        return levers

    def drafts_per_step(self) -> int:
        """The most drafts one request verifies in a step: ``mtp_depth`` with ``mtp``, ``draft_depth`` with
        prompt-lookup drafts, else 0. A verify step runs ``1 + drafts`` rows per request."""
        if self.mtp:
            return self.mtp_depth
        return self.draft_depth if self.draft == "lookup" else 0


class DeployConfig(_Section, kw_only=True):
    """One deployment: which checkpoint, on which ranks, listening where, with which engine settings."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    nodes: list[Annotated[str, msgspec.Meta(min_length=1)]] | None = None
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    ports: PortsConfig = msgspec.field(default_factory=PortsConfig)
    node_env: list[dict[str, str]] = msgspec.field(default_factory=list)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)

    @property
    def world(self) -> int:
        """Number of ranks: one per entry of ``nodes``, else ``world_size``, else 1."""
        if self.nodes:
            return len(self.nodes)
        return self.world_size or 1

    def to_dict(self) -> dict[str, Any]:
        """The effective config (every default filled in) as plain JSON data."""
        return msgspec.to_builtins(self)

    def digest(self) -> str:
        """16 hex digits: FNV-1a 64 of the canonical JSON of the effective config.

        Canonical = sorted keys, no whitespace, defaults filled in: the order of keys in the file and
        spelling out a default change nothing; any changed effective value changes the digest.
        """
        return fnv1a64_hex(canonical_json(self.to_dict()))


def canonical_json(data: Any) -> bytes:
    return json.dumps(
        data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def fnv1a64_hex(data: bytes) -> str:
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"
