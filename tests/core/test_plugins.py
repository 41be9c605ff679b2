"""Plugin discovery: entry points, the DGPP_PLUGINS allow-list, duplicate claims, family resolution."""

from __future__ import annotations

import types
from importlib.metadata import EntryPoint

import pytest

import dgpp.plugins as plugins
from dgpp.errors import PluginError, UnsupportedModelError
from dgpp.family import FamilySpec
from dgpp.hookspecs import hookimpl
from dgpp.plugins import build_manager, families, resolve

IN_TREE = {"qwen", "glm", "deepseek", "mimo", "flint"}


def fake_plugin(module_name: str, family: str, archs: tuple[str, ...], implemented: tuple[str, ...] = ()):
    mod = types.ModuleType(module_name)

    @hookimpl
    def dgpp_families():
        return [FamilySpec(name=family, plugin=module_name, architectures=archs, implemented=implemented)]

    mod.dgpp_families = dgpp_families
    return mod


def test_entry_points_are_discovered(monkeypatch):
    monkeypatch.delenv("DGPP_PLUGINS", raising=False)
    pm = build_manager()
    assert IN_TREE <= {pm.get_name(p) for p in pm.get_plugins()}
    assert IN_TREE <= {f.name for f in families(pm)}
    assert pm.get_plugin("dgpp-core") is not None  # core's built-ins register like a plugin


def test_allow_list_limits_what_loads(monkeypatch):
    monkeypatch.setenv("DGPP_PLUGINS", "qwen, glm")
    pm = build_manager()
    assert {f.name for f in families(pm)} & IN_TREE == {"qwen", "glm"}
    assert build_manager(allow={"flint"}).get_plugin("qwen") is None  # an explicit allow wins over the env


def test_allow_list_naming_an_absent_plugin_is_an_error(monkeypatch):
    monkeypatch.setenv("DGPP_PLUGINS", "qwen,nosuchplugin")
    with pytest.raises(PluginError, match="DGPP_PLUGINS names plugins that are not installed: nosuchplugin"):
        build_manager()


def test_two_plugins_claiming_one_architecture_name_both():
    a = fake_plugin("fake_a", "alpha", ("SharedForCausalLM",))
    b = fake_plugin("fake_b", "beta", ("SharedForCausalLM", "OtherForCausalLM"))
    with pytest.raises(PluginError) as exc:
        build_manager(allow=set(), extra=[a, b])
    msg = str(exc.value)
    assert "'SharedForCausalLM' is claimed by two plugins" in msg
    assert "fake_a (family alpha)" in msg and "fake_b (family beta)" in msg


def test_a_fake_plugin_may_not_claim_an_in_tree_architecture():
    thief = fake_plugin("thief", "stolen", ("Qwen3ForCausalLM",))
    with pytest.raises(PluginError, match="'Qwen3ForCausalLM' is claimed by two plugins: qwen .* thief"):
        build_manager(allow={"qwen"}, extra=[thief])


def test_resolve_by_architecture_then_model_type():
    pm = build_manager(allow=set(), extra=[fake_plugin("fake", "fam", ("FooForCausalLM", "foo"), ("foo",))])
    res = resolve(pm, {"architectures": ["FooForCausalLM"], "model_type": "foo"})
    assert res.family.name == "fam" and res.matched == "foo"  # the implemented value, reached via model_type


def test_claimed_but_unimplemented_is_not_yet_supported():
    pm = build_manager(allow=set(), extra=[fake_plugin("fake", "fam", ("BarForCausalLM",))])
    with pytest.raises(
        UnsupportedModelError, match="'BarForCausalLM' is claimed by plugin fake .* not yet supported"
    ):
        resolve(pm, {"architectures": ["BarForCausalLM"]})


def test_unclaimed_architecture_lists_what_is_claimed():
    pm = build_manager(allow=set(), extra=[fake_plugin("fake", "fam", ("BarForCausalLM",))])
    with pytest.raises(
        UnsupportedModelError, match="no installed plugin claims .*NopeForCausalLM.*claimed: BarForCausalLM"
    ):
        resolve(pm, {"architectures": ["NopeForCausalLM"], "model_type": "nope"})


def test_a_plugin_that_fails_to_import_is_named(monkeypatch):
    broken = EntryPoint(name="broken", value="dgpp_no_such_module_xyz.plugin", group="dgpp")
    monkeypatch.setattr(plugins, "entry_points", lambda group: [broken])
    with pytest.raises(PluginError, match="plugin 'broken' .* failed to load: ModuleNotFoundError"):
        build_manager(allow=None)


def test_two_distributions_with_one_entry_point_name(monkeypatch):
    eps = [
        EntryPoint(name="qwen", value="dgpp_qwen.plugin", group="dgpp"),
        EntryPoint(name="qwen", value="other_qwen.plugin", group="dgpp"),
    ]
    monkeypatch.setattr(plugins, "entry_points", lambda group: eps)
    with pytest.raises(PluginError, match="two installed plugins use the entry-point name 'qwen'"):
        build_manager()


def test_implemented_values_must_be_claimed():
    with pytest.raises(
        PluginError, match="family fam \\(plugin p\\) implements FooForCausalLM without claiming it"
    ):
        FamilySpec(name="fam", plugin="p", architectures=("BarForCausalLM",), implemented=("FooForCausalLM",))
