"""What families offer besides their models (tiny checkpoints, bench geometries, GGUF maps) is declared by their
plugins and found by core through the plugin manager: a third party adds its own without editing core, one name
offered twice is an error naming both, an unknown name lists what is offered, and bench / demo import no test code."""

from __future__ import annotations

import ast
import json
import re
import types
from pathlib import Path

import pytest
from test_layering import import_graph

from dgpp import catalog
from dgpp.errors import PluginError
from dgpp.family_contract import Family
from dgpp.hookspecs import hookimpl
from dgpp.offers import BenchGeometry, GGUFArchitecture, TinyCheckpoint
from dgpp.plugins import build_manager

# every name the moved builders, geometries and maps had in core, now each offered by its family's plugin
TINY = {
    "llama",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_vl",
    "qwen3_5_moe_vl",
    "qwen3-chat",
    "qwen4_exp",
    "glm4_moe",
    "glm_moe_dsa",
    "glm5_next",
    "mimo",
    "flint",
    "deepseek_v4",
}
GEOMETRIES = {
    "qwen3-8b",
    "qwen3.5-27b",
    "qwen3.5-122b-a10b-24l",
    "tiny",
    "tiny-qwen3.5",
    "tiny-qwen3.5-moe",
    "mimo-v2.6-flash-8l",
    "tiny-mimo-v2.6",
    "deepseek-v4-flash-8l",
    "tiny-deepseek-v4",
    "deepseek-v4.1-flash-8l",
    "tiny-deepseek-v41",
    "glm-5.3-12l",
    "glm-5.3-flash-6l",
    "tiny-glm-5.3-flash",
    "qwen3.8-flash-next-8l",
    "tiny-qwen3.8-flash-next",
}
OWNERS = {
    "qwen3": "qwen",
    "qwen3-chat": "qwen",
    "qwen4_exp": "qwen",
    "glm4_moe": "glm",
    "glm_moe_dsa": "glm",
    "glm5_next": "glm",
    "mimo": "mimo",
    "flint": "flint",
    "deepseek_v4": "deepseek",
    "llama": "llama",
}


def _write_marker(out_dir: str | Path, *, seed: int = 0, **options: object) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"seed": seed, **{k: str(v) for k, v in options.items()}}))
    return out


def _third_party(
    name: str = "thirdparty", tiny: str = "toy_tiny", geometry: str = "toy-1b"
) -> types.ModuleType:
    """A plugin module offering one tiny checkpoint and one geometry with hand-written hookimpls."""
    mod = types.ModuleType(name)

    @hookimpl
    def dgpp_tiny_checkpoints():
        return [TinyCheckpoint(tiny, _write_marker, "a toy")]

    @hookimpl
    def dgpp_bench_geometries():
        return [BenchGeometry(geometry, {"model_type": "toy", "hidden_size": 8})]

    mod.dgpp_tiny_checkpoints = dgpp_tiny_checkpoints
    mod.dgpp_bench_geometries = dgpp_bench_geometries
    return mod


def test_every_installed_family_offers_what_core_used_to_hard_code():
    pm = build_manager(allow=None)
    tiny = catalog.tiny_checkpoints(pm)
    assert TINY <= set(tiny)
    assert GEOMETRIES <= set(catalog.bench_geometries(pm))
    assert set(catalog.gguf_architectures(pm)) >= {"llama"}
    owners = {name: plugin for plugin, offers in _answers(pm, "dgpp_tiny_checkpoints") for name in offers}
    assert {name: owners[name] for name in OWNERS} == OWNERS  # each offered by the plugin of its family


def _answers(pm, hook: str) -> list[tuple[str, list[str]]]:
    from dgpp.plugins import answers_by_plugin

    return [(plugin, [offer.name for offer in batch or []]) for plugin, batch in answers_by_plugin(pm, hook)]


def test_a_third_party_plugin_adds_its_own_without_editing_core(tmp_path):
    pm = build_manager(allow=set(), extra=[_third_party()])
    assert set(catalog.tiny_checkpoints(pm)) == {"toy_tiny"}
    out = catalog.tiny_checkpoint("toy_tiny", pm).build(tmp_path / "t", seed=7, overrides={"a": 1})
    assert json.loads((out / "config.json").read_text()) == {"seed": 7, "overrides": "{'a': 1}"}
    assert catalog.bench_geometry("toy-1b", pm).hf_config == {"model_type": "toy", "hidden_size": 8}


def test_one_name_offered_by_two_plugins_names_both():
    pm = build_manager(allow=set(), extra=[_third_party("plugin_a"), _third_party("plugin_b")])
    with pytest.raises(
        PluginError, match="bench geometry 'toy-1b' is offered by two plugins: plugin_a and plugin_b"
    ):
        catalog.bench_geometries(pm)
    with pytest.raises(PluginError, match="tiny checkpoint 'toy_tiny' is offered by two plugins"):
        catalog.tiny_checkpoints(pm)


def test_an_unknown_name_lists_what_is_offered():
    pm = build_manager(allow=set(), extra=[_third_party()])
    with pytest.raises(
        PluginError, match=r"no installed plugin offers the tiny checkpoint 'nope'.*offered: toy_tiny"
    ):
        catalog.tiny_checkpoint("nope", pm)
    with pytest.raises(
        PluginError, match=r"bench geometry 'qwen3-8b' \(dgpp_bench_geometries\); offered: toy-1b"
    ):
        catalog.bench_geometry("qwen3-8b", pm)  # without the Qwen plugin, core knows no Qwen geometry
    assert catalog.gguf_architectures(pm) == {}


def test_a_family_offers_through_references(tmp_path, monkeypatch):
    """A ``Family`` names its offer functions like its other references; without them it offers nothing."""
    (tmp_path / "fakefam_offers.py").write_text(
        "from dgpp.offers import GGUFArchitecture\n"
        "def gguf():\n"
        "    return [GGUFArchitecture('fakearch', lambda gguf, vocab: {}, {'output': 'lm_head'}, {})]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    family = Family(
        name="fake",
        plugin="fake",
        architectures=("FakeForCausalLM",),
        models=(),
        gguf_architectures="fakefam_offers:gguf",
    )
    pm = build_manager(allow=set(), extra=[family])
    arch = catalog.gguf_architectures(pm)["fakearch"]
    assert isinstance(arch, GGUFArchitecture) and arch.global_names == {"output": "lm_head"}
    assert catalog.tiny_checkpoints(pm) == {}
    assert family.dgpp_tiny_checkpoints() == [] and family.dgpp_bench_geometries() == []


def test_bench_and_demo_import_no_test_code():
    graph = import_graph()
    tools = [m for m in graph if m.startswith(("dgpp.bench", "dgpp.demo", "dgpp.checkpoint"))]
    assert "dgpp.bench.models" in tools and "dgpp.demo" in tools
    offenders = {m: sorted(t for t in graph[m] if t.startswith("dgpp.testing")) for m in tools}
    assert {m: t for m, t in offenders.items() if t} == {}


FAMILY = re.compile(r"glm|qwen|deepseek|mimo|flint|llama", re.I)
# the core modules that held family knowledge before the families offered it (and the two that find it)
FAMILY_FREE = (
    "bench/models.py",
    "checkpoint/gguf_arch.py",
    "checkpoint/gguf_convert.py",
    "testing/builders.py",
    "offers.py",
    "catalog.py",
)


def _names_in_code(path: Path) -> set[str]:
    """Family names in identifiers, imports and strings of ``path`` (docstrings and comments may name examples)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    words: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.append(node.value)
        elif isinstance(node, ast.Name):
            words.append(node.id)
        elif isinstance(node, ast.Attribute):
            words.append(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            words += [getattr(node, "module", None) or "", *(a.name for a in node.names)]
    return {m.group(0).lower() for word in words for m in FAMILY.finditer(word)}


def test_the_modules_that_found_families_name_none():
    core = Path(catalog.__file__).parent
    assert {name: _names_in_code(core / name) for name in FAMILY_FREE} == {
        name: set() for name in FAMILY_FREE
    }
