"""FamilyHooks: one family's hookimpls from a FamilySpec and lazy "module:function" references."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pluggy
import pytest

from dgpp import hookspecs
from dgpp.errors import PluginError
from dgpp.family import FamilySpec, LoadContext
from dgpp.family_hooks import FamilyHooks
from dgpp.hookspecs import hookimpl
from dgpp.plugins import families, resolve

IMPL_SOURCE = """
def load_model(ctx):
    return ("model", ctx.architecture)

def dialect_for(hf_config):
    return ("dialect", hf_config.get("model_type"))

def chat_template(hf_config):
    return "template for " + hf_config.get("model_type", "?")

def build_draft(ctx, model):
    return ("draft", model)

def memory_plan(ctx):
    return ("plan", ctx.hf_config["model_type"])
"""


def _spec(name: str = "fake") -> FamilySpec:
    return FamilySpec(
        name=name,
        plugin=f"dgpp-{name}",
        architectures=(f"{name.title()}ForCausalLM",),
        model_types=(f"{name}_a", f"{name}_b"),
        implemented=(f"{name.title()}ForCausalLM", f"{name}_a", f"{name}_b"),
    )


def _plugin_module(hooks: FamilyHooks, name: str) -> types.ModuleType:
    """A module shaped like an in-tree plugin.py: the hooks exported into its namespace."""
    module = types.ModuleType(name)
    vars(module).update(hooks.hookimpls())
    return module


def _manager(*modules: types.ModuleType) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for module in modules:
        pm.register(module, name=module.__name__)
    return pm


def _ctx(family: str, model_type: str) -> LoadContext:
    return LoadContext(
        checkpoint_dir=Path("."),
        hf_config={"model_type": model_type},
        family=family,
        architecture=f"{family.title()}ForCausalLM",
    )


@pytest.fixture
def impl_module(tmp_path, monkeypatch) -> str:
    """A fresh importable implementation module per test, so laziness can be observed in sys.modules."""
    name = f"fakefam_impl_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(IMPL_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _full_hooks(spec: FamilySpec, impl: str, **extra) -> FamilyHooks:
    return FamilyHooks(
        spec,
        load_model=f"{impl}:load_model",
        tool_dialect=f"{impl}:dialect_for",
        chat_template=f"{impl}:chat_template",
        build_draft=f"{impl}:build_draft",
        memory_plan=f"{impl}:memory_plan",
        **extra,
    )


def test_answers_only_for_its_family_and_imports_lazily(impl_module):
    pm = _manager(_plugin_module(_full_hooks(_spec(), impl_module), "fake_plugin"))
    assert impl_module not in sys.modules  # registering imports no implementation module
    assert [f.name for f in families(pm)] == ["fake"]
    assert resolve(pm, {"architectures": ["FakeForCausalLM"]}).family.name == "fake"

    other = _ctx("other", "fake_a")
    assert pm.hook.dgpp_load_model(ctx=other) is None
    assert pm.hook.dgpp_memory_plan(ctx=other) is None
    assert pm.hook.dgpp_build_draft(ctx=other, model="m") is None
    assert pm.hook.dgpp_tool_dialect(family="other", hf_config={}) is None
    assert pm.hook.dgpp_chat_template(family="other", hf_config={}) is None
    assert impl_module not in sys.modules  # another family's request imports nothing either

    ours = _ctx("fake", "fake_b")
    assert pm.hook.dgpp_load_model(ctx=ours) == ("model", "FakeForCausalLM")
    assert impl_module in sys.modules
    assert pm.hook.dgpp_memory_plan(ctx=ours) == ("plan", "fake_b")
    assert pm.hook.dgpp_build_draft(ctx=ours, model="m") == ("draft", "m")
    assert pm.hook.dgpp_tool_dialect(family="fake", hf_config={"model_type": "fake_a"}) == ("dialect", "fake_a")
    assert pm.hook.dgpp_chat_template(family="fake", hf_config={"model_type": "fake_a"}) == "template for fake_a"


def test_two_families_each_answer_their_own(impl_module):
    pm = _manager(
        _plugin_module(_full_hooks(_spec("fake"), impl_module), "fake_plugin"),
        _plugin_module(FamilyHooks(_spec("toy2"), load_model="builtins:repr"), "toy2_plugin"),
    )
    assert pm.hook.dgpp_load_model(ctx=_ctx("fake", "fake_a")) == ("model", "FakeForCausalLM")
    assert pm.hook.dgpp_load_model(ctx=_ctx("toy2", "toy2_a")).startswith("LoadContext(")
    assert pm.hook.dgpp_memory_plan(ctx=_ctx("toy2", "toy2_a")) is None  # toy2 has no memory plan


def test_only_model_types_narrows_one_hook(impl_module):
    hooks = _full_hooks(_spec(), impl_module, only_model_types={"memory_plan": ("fake_b",)})
    pm = _manager(_plugin_module(hooks, "fake_plugin"))
    assert pm.hook.dgpp_memory_plan(ctx=_ctx("fake", "fake_a")) is None  # generic estimate applies
    assert pm.hook.dgpp_memory_plan(ctx=_ctx("fake", "fake_b")) == ("plan", "fake_b")
    assert pm.hook.dgpp_load_model(ctx=_ctx("fake", "fake_a")) is not None  # other hooks unaffected


def test_hooks_without_reference_are_not_exported():
    hooks = FamilyHooks(_spec(), load_model="fakefam_never_imported:load_model")
    assert sorted(hooks.hookimpls()) == ["dgpp_families", "dgpp_load_model"]
    pm = _manager(_plugin_module(hooks, "fake_plugin"))
    assert pm.hook.dgpp_memory_plan.get_hookimpls() == []
    assert pm.hook.dgpp_tool_dialect.get_hookimpls() == []


def test_the_object_registers_only_the_hooks_it_was_given(impl_module):
    """An entry point names the FamilyHooks object itself: pluggy registers what ``hookimpls()`` lists, no more."""
    bare = FamilyHooks(_spec(), load_model=f"{impl_module}:load_model")
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(bare, name="bare")
    assert pm.hook.dgpp_memory_plan.get_hookimpls() == [] and pm.hook.dgpp_build_draft.get_hookimpls() == []
    assert pm.hook.dgpp_load_model(ctx=_ctx("fake", "fake_a")) == ("model", "FakeForCausalLM")
    assert pm.hook.dgpp_load_model(ctx=_ctx("other", "fake_a")) is None


def test_bad_references_are_clear_errors(impl_module):
    with pytest.raises(PluginError, match="'fakefam_impl' is not of the form"):
        FamilyHooks(_spec(), load_model="fakefam_impl")
    with pytest.raises(PluginError, match="unknown hooks memory"):
        FamilyHooks(_spec(), load_model="x:y", only_model_types={"memory": ("fake_a",)})
    hooks = FamilyHooks(_spec(), load_model=f"{impl_module}:no_such_function")
    pm = _manager(_plugin_module(hooks, "fake_plugin"))
    with pytest.raises(PluginError, match="has no callable no_such_function"):
        pm.hook.dgpp_load_model(ctx=_ctx("fake", "fake_a"))


def test_explicit_hookimpl_style_still_works_beside_family_hooks(impl_module):
    """A third-party plugin written with hand-made @hookimpl functions keeps working next to FamilyHooks ones."""
    legacy = types.ModuleType("legacy_plugin")

    @hookimpl
    def dgpp_families():
        return [_spec("legacy")]

    @hookimpl
    def dgpp_load_model(ctx):
        return "legacy model" if ctx.family == "legacy" else None

    legacy.dgpp_families = dgpp_families
    legacy.dgpp_load_model = dgpp_load_model
    pm = _manager(legacy, _plugin_module(_full_hooks(_spec(), impl_module), "fake_plugin"))
    assert sorted(f.name for f in families(pm)) == ["fake", "legacy"]
    assert pm.hook.dgpp_load_model(ctx=_ctx("legacy", "legacy_a")) == "legacy model"
    assert pm.hook.dgpp_load_model(ctx=_ctx("fake", "fake_a")) == ("model", "FakeForCausalLM")


def test_in_tree_plugins_register_without_importing_implementations():
    """Building the real plugin manager imports no family loader/model module, nor torch."""
    code = textwrap.dedent(
        """
        import sys
        from dgpp.plugins import build_manager
        pm = build_manager()
        heavy = sorted(m for m in sys.modules if m.startswith("dgpp_") and not m.endswith((".plugin",)) and "." in m)
        print("torch" in sys.modules, heavy)
        print(sorted(i.plugin_name for i in pm.hook.dgpp_memory_plan.get_hookimpls()))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "False []"
    assert all(family in out[1] for family in ("glm", "qwen", "flint", "mimo"))


def test_in_tree_special_cases_are_kept():
    """Qwen's memory plan answers only for qwen4_exp; every dialect family's fallback template comes through the hook."""
    from dgpp.plugins import build_manager
    from dgpp_deepseek import dialect as deepseek_dialect
    from dgpp_flint import dialect as flint_dialect
    from dgpp_qwen import dialect as qwen_dialect
    from dgpp_qwen import plugin as qwen_plugin

    assert qwen_plugin.HOOKS.dgpp_memory_plan(_ctx("qwen", "qwen3")) is None
    assert qwen_plugin.HOOKS.dgpp_memory_plan(_ctx("glm", "qwen4_exp")) is None
    pm = build_manager()
    assert pm.hook.dgpp_chat_template(family="qwen", hf_config={}) == qwen_dialect.chat_template()
    v41 = {"model_type": "deepseek_v41"}
    assert pm.hook.dgpp_chat_template(family="deepseek", hf_config=v41) == deepseek_dialect.chat_template(v41)
    assert pm.hook.dgpp_chat_template(family="flint", hf_config={}) == flint_dialect.chat_template()
