"""The ``dgpp`` command: ``serve``, ``check``, ``plugins``, ``templates``, ``bench`` and ``--version``.

``serve`` and ``check`` take a template file, a shipped template's name or a model (``dgpp.cli_target``).

Exit codes follow the original engine: 0 orderly, 1 a startup/contract error (bad template, missing
checkpoint, unsupported model, memory plan refusal), 2 a usage error (argparse).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import TYPE_CHECKING, Any

from dgpp.cli_target import DEFAULT_MEMORY_FRACTION, resolve_target
from dgpp.config import KNOB_KEYS, REFUSED_KNOBS, DeployConfig, load_config
from dgpp.errors import DgppError

if TYPE_CHECKING:
    from dgpp.startup.deployment import Deployment

# (flag, dest, type, help); every dest is a key of dgpp.config.KNOB_KEYS
_KNOB_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--max-concurrency", "max_concurrency", int, "engine.max_concurrency: active request slots"),
    ("--kv-capacity", "kv_capacity", int, "engine.kv_capacity: shared KV pool, tokens per rank"),
    ("--mtp-depth", "mtp_depth", int, "engine.mtp_depth: drafts per step"),
    ("--draft", "draft", str, "engine.draft: off|lookup (prompt-lookup drafts, any model)"),
    ("--draft-depth", "draft_depth", int, "engine.draft_depth: lookup drafts per step"),
    (
        "--kv-dtype",
        "kv_dtype",
        str,
        "engine.kv_dtype: auto|bf16|fp8|fp4 (fp8: e4m3 rows; fp4: MLA latents; lossy)",
    ),
    ("--dtype", "dtype", str, "engine.dtype: auto|float32|bfloat16|float16 (compute dtype)"),
    ("--prefix-cache-gib", "prefix_cache_gib", float, "engine.prefix_cache_gib (0 disables)"),
    ("--dense-weights", "dense_weights", str, "engine.dense_weights: checkpoint|fp8"),
    ("--bf16-weights", "bf16_weights", str, "engine.bf16_weights: checkpoint|bf12|bf12+bf16"),
    ("--gguf-weights", "gguf_weights", str, "engine.gguf_weights: decoded|int4pack"),
    ("--port", "port", int, "http.port"),
    ("--host", "host", str, "http.bind_host"),
]


class _Refuse(argparse.Action):
    """A topology/model flag given as a knob: refused by name (they change which ranks or weights exist)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None
    ):
        parser.error(
            f"{option_string} is not a knob: the model and topology come from the template; edit it instead"
        )


def _add_knob_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("knobs (override the template's keys for this run)")
    for flag, dest, typ, text in _KNOB_FLAGS:
        g.add_argument(flag, dest=dest, type=typ, default=None, help=text)
    g.add_argument(
        "--no-mtp", dest="mtp", action="store_const", const=False, default=None, help="engine.mtp = false"
    )
    g.add_argument("--mtp", dest="mtp", action="store_const", const=True, help="engine.mtp = true")
    for key in REFUSED_KNOBS:
        g.add_argument(f"--{key.replace('_', '-')}", action=_Refuse, nargs="?", help=argparse.SUPPRESS)


def _knob_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="--knobs", add_help=False)
    _add_knob_flags(p)
    return p


def collect_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """Knob values from ``--knobs "FLAGS"`` (the launcher's form) and from flags given directly (which win)."""
    knobs: dict[str, Any] = {}
    if getattr(args, "knobs", None):
        inner = _knob_parser().parse_args(shlex.split(args.knobs))
        knobs.update({k: v for k, v in vars(inner).items() if k in KNOB_KEYS and v is not None})
    knobs.update({k: v for k, v in vars(args).items() if k in KNOB_KEYS and v is not None})
    return knobs


def build_parser() -> argparse.ArgumentParser:
    from dgpp import __version__

    parser = argparse.ArgumentParser(
        prog="dgpp", description="dgpp: an LLM inference engine with an OpenAI-compatible API"
    )
    parser.add_argument("--version", action="version", version=f"dgpp {__version__}")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console lines")
    parser.add_argument(
        "--log-level", default=None, help="debug|info|warning|error (default: $DGPP_LOG_LEVEL or info)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a deployment template")
    check = sub.add_parser(
        "check", help="validate a template, resolve checkpoint and family, print the memory plan"
    )
    for p in (serve, check):
        p.add_argument(
            "config",
            metavar="CONFIG",
            help="a deployment template (JSON file or a name from `dgpp templates`), or a model: "
            "checkpoint directory, .gguf file or HF id in the local cache (a world-1 deployment with defaults)",
        )
        p.add_argument(
            "--knobs", default=None, help='knob flags as one string, e.g. "--no-mtp --kv-capacity 4096"'
        )
        p.add_argument(
            "--memory-fraction",
            type=float,
            default=None,
            help=f"for a model: the share of free memory the engine may use; the KV pool gets what the "
            f"rest of the memory plan leaves (default {DEFAULT_MEMORY_FRACTION}; --kv-capacity overrides)",
        )
        _add_knob_flags(p)
    serve.add_argument(
        "--rank",
        type=int,
        default=None,
        help="this process's rank in a world of several (nodes / world_size)",
    )
    check.add_argument(
        "--device", default=None, help="where the pools would live (default: cuda if present, else cpu)"
    )
    check.add_argument("--headroom-gib", type=float, default=None, help="memory kept free (default 4)")
    check.add_argument(
        "--free-gib", type=float, default=None, help="assume this much free memory instead of measuring"
    )
    serve.set_defaults(func=cmd_serve)
    check.set_defaults(func=cmd_check)

    launch = sub.add_parser(
        "launch", help="start every local rank of a multi-rank template (one process per rank)"
    )
    launch.add_argument("config", metavar="CONFIG", help="deployment template (JSON file or template name)")
    launch.add_argument("--knobs", default=None, help="knob flags as one string, passed to every rank")
    launch.set_defaults(func=cmd_launch)

    plugins = sub.add_parser(
        "plugins", help="installed plugins, families, architectures, quant formats, templates"
    )
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.set_defaults(func=cmd_plugins)
    templates = sub.add_parser("templates", help="deployment templates shipped by the plugins (and deploy/)")
    templates.add_argument("--json", action="store_true", help="machine-readable output")
    templates.add_argument(
        "--write",
        nargs="+",
        metavar=("NAME", "PATH"),
        default=None,
        help="write a copy of template NAME to PATH (a file or directory; default ./NAME.json) to edit",
    )
    templates.set_defaults(func=cmd_templates)
    bench = sub.add_parser(
        "bench", help="decode benchmark on a CUDA GPU: roofline and transformers (docs/benchmarks.md)"
    )
    from dgpp.bench.args import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    cfg, target = resolve_target(args.config, collect_knobs(args), args.memory_fraction)
    if cfg.world > 1 or args.rank not in (None, 0):
        if args.rank is None:
            print(
                f"dgpp serve: the template describes a world of {cfg.world} ranks: give --rank R on each node, "
                f"or `dgpp launch {args.config}` for the ranks of this machine",
                file=sys.stderr,
            )
            return 1
        from dgpp.dist.serve_rank import serve_rank

        return serve_rank(cfg, args.rank, _startup_checks(cfg, target.label))
    from dgpp.server_assembly import serve_deployment

    serve_deployment(cfg, deployment=_startup_checks(cfg, target.label))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from dgpp.cli_target import classify
    from dgpp.dist.launch import launch

    target = classify(args.config)
    if target.template is None:
        print(
            f"dgpp launch: {args.config} is a model; launch starts the ranks of a template", file=sys.stderr
        )
        return 1
    cfg = load_config(target.template, collect_knobs(args))
    return launch(str(target.template), cfg, ["--knobs", args.knobs] if args.knobs else [])


def _startup_checks(cfg: DeployConfig, path: str) -> Deployment:
    """Log what is being served (digest, lossy levers) and refuse a memory plan that does not fit; the resolved
    deployment (checkpoint, config.json, family) is what the model is then loaded from."""
    from importlib.util import find_spec

    from dgpp.extras import install_hint
    from dgpp.log import get_logger
    from dgpp.preflight import preflight, require_fit
    from dgpp.step.memory import format_bytes

    log = get_logger("dgpp.serve")
    found = preflight(cfg)
    fam = found.resolution.family
    log.info(
        "deployment",
        config=path,
        digest=cfg.digest(),
        model=cfg.model,
        checkpoint=str(found.checkpoint),
        family=fam.name,
        plugin=fam.plugin,
        world=cfg.world,
    )
    if found.device.startswith("cuda") and find_spec("triton") is None:
        log.warning(
            "Triton kernels off: every op runs its torch reference", hint=install_hint("triton", "gpu")
        )
    for lever in cfg.engine.lossy_levers():
        log.warning("lossy lever on: results may differ from the exact chain", key=f"engine.{lever}")
    require_fit(cfg, found)
    log.info(
        "memory plan fits",
        need=format_bytes(found.plan.total()),
        free=format_bytes(found.free_bytes),
        device=found.device,
    )
    return found.deployment


def cmd_check(args: argparse.Namespace) -> int:
    from dgpp.cli_report import check_deployment

    return check_deployment(args, collect_knobs(args))


def cmd_plugins(args: argparse.Namespace) -> int:
    from dgpp.cli_report import list_plugins

    return list_plugins(as_json=args.json)


def cmd_templates(args: argparse.Namespace) -> int:
    from dgpp.cli_report import list_templates

    if args.write:
        from dgpp.cli_target import write_template_copy

        if len(args.write) > 2:
            print("dgpp templates: --write takes NAME and at most one PATH", file=sys.stderr)
            return 2
        written = write_template_copy(*args.write)
        print(f"wrote {written} (edit it, then `dgpp check {written}`)")
        return 0
    return list_templates(as_json=args.json)


def cmd_bench(args: argparse.Namespace) -> int:
    from dgpp.bench.cli import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    from dgpp.demo import enable_demo_checkpoints
    from dgpp.log import configure_logging

    enable_demo_checkpoints()  # every command that takes a model (serve, check, TP ranks) builds demo ids
    args = build_parser().parse_args(argv)
    try:
        configure_logging(json=args.log_json, level=args.log_level)
    except ValueError as exc:
        print(f"dgpp: {exc}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except DgppError as exc:
        print(f"dgpp {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
