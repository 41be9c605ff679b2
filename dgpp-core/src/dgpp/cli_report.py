"""What ``dgpp check``, ``dgpp plugins`` and ``dgpp templates`` print (stdout: results; stderr: refusals)."""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from dgpp.errors import DgppError


def check_deployment(args: argparse.Namespace, knobs: dict[str, Any]) -> int:
    """Everything startup would refuse, without loading weights; 0 when the deployment would start."""
    from dgpp.cli_target import resolve_target
    from dgpp.preflight import preflight, require_fit
    from dgpp.step.memory import GiB, format_bytes

    measured = {
        "device": args.device,
        "headroom": int(args.headroom_gib * GiB) if args.headroom_gib is not None else None,
        "free_bytes": int(args.free_gib * GiB) if args.free_gib is not None else None,
    }
    cfg, target = resolve_target(args.config, knobs, args.memory_fraction, **measured)
    print(f"config       {target.label} (digest {cfg.digest()})")
    if target.model is not None:
        sized = "given" if "kv_capacity" in knobs else "sized to the free memory"
        print(f"deployment   world 1, defaults; engine.kv_capacity {cfg.engine.kv_capacity} ({sized})")
    found = preflight(cfg, **measured)
    fam = found.resolution.family
    print(f"checkpoint   {cfg.model} -> {found.checkpoint}")
    print(f"family       {fam.name} (plugin {fam.plugin}) for {found.resolution.matched}")
    print(f"world        {cfg.world} rank(s); listening on {cfg.http.bind_host}:{cfg.http.port}")
    from dgpp.dist.fabric import probe  # RDMA lanes for NCCL, or why collectives stay on TCP

    for line in probe().lines():
        print(line)
    print(f"lossy levers {', '.join(cfg.engine.lossy_levers()) or 'none'}")
    print("memory plan  (per rank)")
    for line in found.plan.describe():
        print(f"  {line}")
    require_fit(cfg, found)
    print(
        f"fits         {format_bytes(found.free_bytes)} free on {found.device}, {format_bytes(found.headroom)} headroom kept"
    )
    print("ready")
    return 0


def _plugin_version(pm: Any, name: str) -> str:
    from dgpp.plugins import CORE_NAME, installed_entry_points

    if name == CORE_NAME:
        dist = CORE_NAME
    else:
        ep = installed_entry_points().get(name)
        dist = ep.dist.name if ep is not None and getattr(ep, "dist", None) else None
    try:
        return f"{dist} {version(dist)}" if dist else "(registered directly)"
    except PackageNotFoundError:
        return str(dist)


def _label(obj: Any) -> str:
    return str(getattr(obj, "name", obj))


def plugin_report(pm: Any) -> list[dict[str, Any]]:
    """One record per registered plugin: distribution, families (implemented / claimed), quant formats, templates."""
    from dgpp.plugins import answers_by_plugin

    report: dict[str, dict[str, Any]] = {}
    for name in [pm.get_name(p) for p in pm.get_plugins()]:
        report[name] = {
            "name": name,
            "distribution": _plugin_version(pm, name),
            "families": [],
            "quant_formats": [],
            "templates": [],
        }
    for name, fams in answers_by_plugin(pm, "dgpp_families"):
        for fam in fams or []:
            report[name]["families"].append(
                {
                    "name": fam.name,
                    "description": fam.description,
                    "implemented": list(fam.implemented),
                    "claimed": [
                        v for v in (*fam.architectures, *fam.model_types) if v not in fam.implemented
                    ],
                }
            )
    for name, formats in answers_by_plugin(pm, "dgpp_quant_formats"):
        report[name]["quant_formats"] += [_label(f) for f in formats or []]
    for name, paths in answers_by_plugin(pm, "dgpp_deploy_templates"):
        report[name]["templates"] += [str(p) for p in paths or []]
    return sorted(report.values(), key=lambda r: (r["name"] != "dgpp-core", r["name"]))


def list_plugins(as_json: bool = False) -> int:
    from dgpp.plugins import manager

    report = plugin_report(manager())
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    for rec in report:
        print(f"{rec['name']}  [{rec['distribution']}]")
        for fam in rec["families"]:
            print(f"  family {fam['name']}: {fam['description']}")
            print(f"    implemented: {', '.join(fam['implemented']) or 'none yet'}")
            print(f"    claimed, not yet supported: {', '.join(fam['claimed']) or 'none'}")
        print(f"  quant formats: {', '.join(rec['quant_formats']) or 'none'}")
        if rec["templates"]:
            print(f"  templates: {len(rec['templates'])} (see `dgpp templates`)")
    return 0


def template_report() -> list[dict[str, Any]]:
    """Every known template with its model, world and whether it validates."""
    from dgpp.cli_target import known_templates
    from dgpp.config import load_config

    out = []
    for tpl in known_templates():
        rec: dict[str, Any] = {"source": tpl.source, "path": str(tpl.path), "name": tpl.name}
        try:
            cfg = load_config(tpl.path)
            rec.update(model=cfg.model, world=cfg.world, valid=True, digest=cfg.digest())
        except DgppError as exc:
            rec.update(valid=False, error=str(exc))
        out.append(rec)
    return out


def list_templates(as_json: bool = False) -> int:
    report = template_report()
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    if not report:
        print(
            "no templates found: install a family plugin (e.g. pip install dgpp-qwen) "
            "or set DGPP_DEPLOY_DIR to a directory of templates",
            file=sys.stderr,
        )
    for rec in report:
        status = f"{rec['model']}  w{rec['world']}" if rec["valid"] else f"INVALID: {rec['error']}"
        print(f"{rec['name']:<44} {rec['source']:<10} {status}")
    if report:
        print("serve one by name (`dgpp serve NAME`), or copy it to edit: `dgpp templates --write NAME`")
    return 0 if all(r["valid"] for r in report) else 1
