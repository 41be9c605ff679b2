"""The family contract: a plugin declares one ``Family``, checked at registration; core loads the declared model
and plans its memory from the model built on ``meta`` (every weight-form key counted) with the cache entries its
attention modules declare. Exercised through the example plugin (Llama) on tiny checkpoints."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import msgspec
import pytest
import torch

from dgpp.config_schema import EngineConfig
from dgpp.engine.loading import load_context, load_model
from dgpp.engine.memory_plan import plan_for
from dgpp.errors import PluginError
from dgpp.family import FamilyContract, FamilyModel, World
from dgpp.family_contract import Family
from dgpp.nn.attention import PagedAttention
from dgpp.plugins import build_manager, check_contract, installed_entry_points
from dgpp.quant.resident import fp8_block_bytes
from dgpp.step.cache_spec import PagedKV
from dgpp.step.model import collect_cache_entries
from dgpp.testing.builders import build_tiny_checkpoint

pytest.importorskip("dgpp_llama", reason="the example plugin is installed by scripts/setup.sh")

TOY = FamilyModel(claims=("ToyForCausalLM",), config="toy.config:ToyConfig", model="toy.model:Toy")


def test_a_declaration_that_cannot_work_is_refused_at_registration():
    with pytest.raises(PluginError, match="loads ToyForCausalLM without the family claiming it"):
        Family(name="toy", plugin="dgpp-toy", architectures=("OtherForCausalLM",), models=(TOY,))
    with pytest.raises(PluginError, match="unknown model hooks build_everything"):
        Family(name="toy", plugin="dgpp-toy", architectures=("ToyForCausalLM",),
               models=(FamilyModel(claims=TOY.claims, config=TOY.config, model=TOY.model,
                                   hooks={"build_everything": "toy.x:f"}),))
    with pytest.raises(PluginError, match="'toy.model.Toy' is not of the form"):
        Family(name="toy", plugin="dgpp-toy", architectures=("ToyForCausalLM",),
               models=(FamilyModel(claims=TOY.claims, config=TOY.config, model="toy.model.Toy"),))


def test_claims_without_a_model_are_not_yet_supported():
    family = Family(name="toy", plugin="dgpp-toy", architectures=("ToyForCausalLM", "Toy2ForCausalLM"),
                    models=(TOY,))
    (spec,) = family.families()
    assert spec.implemented == ("ToyForCausalLM",) and spec.claims("Toy2ForCausalLM")
    assert isinstance(family, FamilyContract)


def test_every_installed_family_registers_through_the_contract():
    """Each installed family plugin's entry point names a Family (no hand-written family hooks); the in-tree
    families listed here still register through the older FamilyHooks and are moved one at a time."""
    from dgpp.family_hooks import FamilyHooks

    legacy = {"qwen"}
    for name, ep in installed_entry_points().items():
        plugin = ep.load()
        if name in legacy:
            assert isinstance(plugin, FamilyHooks), name
        else:
            assert isinstance(plugin, FamilyContract), f"{name} ({ep.value}) does not declare a Family"


def test_hand_written_family_hooks_are_refused():
    import types

    from dgpp.hookspecs import hookimpl

    module = types.ModuleType("toy_plugin")
    module.dgpp_families = hookimpl(lambda: [])
    ep = EntryPoint("toy", "toy_plugin", "dgpp")
    with pytest.raises(PluginError, match="declares families with hand-written hooks; declare them with"):
        check_contract("toy", ep, module)
    formats_only = types.ModuleType("formats_plugin")
    formats_only.dgpp_quant_formats = hookimpl(lambda: [])
    check_contract("formats", ep, formats_only)  # a plugin that adds no family may be plain hookimpls


def test_attention_modules_declare_the_cache_layout(tmp_path):
    model = load_model(build_tiny_checkpoint("llama", tmp_path / "llama"))
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    spec = model.cache_spec()
    assert list(spec) == [m.cache_name for m in layers] and len(spec) == model.config.num_hidden_layers
    assert all(s == PagedKV(2, 16, torch.float32) for s in spec.values())
    twice = torch.nn.Sequential(layers[0], PagedAttention(layers[0].cache_name, 4, 2, 16))
    with pytest.raises(ValueError, match="declared by two modules"):
        collect_cache_entries(twice, torch.float32)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("keys", [{}, {"dense_weights": "fp8"}])
def test_the_plan_counts_the_model_as_it_loads(tmp_path, keys):
    """Weights planned on meta equal the loaded model's parameter bytes, with the weight-form keys applied."""
    checkpoint = build_tiny_checkpoint("llama", tmp_path / "llama", dtype=torch.bfloat16)
    engine = msgspec.structs.replace(EngineConfig(), **keys)
    pm = build_manager()
    plan = plan_for(pm, load_context(checkpoint, engine, pm=pm))
    loaded = load_model(checkpoint, engine, pm=pm)
    assert plan.weights == _param_bytes(loaded)
    assert plan.kv_per_token == sum(s.bytes_per_token() for s in loaded.cache_spec().values())
    assert plan.activations_per_token == (8 * loaded.config.hidden_size + 3 * loaded.config.intermediate_size) * 2
    if keys:
        dense = plan_for(pm, load_context(checkpoint, EngineConfig(), pm=pm)).weights
        linears = [p for n, p in loaded.named_parameters() if n.endswith("_proj.weight")]
        assert linears and dense - plan.weights == sum(p.numel() * 2 - fp8_block_bytes(*p.shape) for p in linears)


def test_the_plan_splits_kv_heads_over_ranks(tmp_path):
    checkpoint = build_tiny_checkpoint("llama", tmp_path / "llama")
    pm = build_manager()
    one = plan_for(pm, load_context(checkpoint, pm=pm))
    two = plan_for(pm, load_context(checkpoint, world=World(0, 2), pm=pm))
    assert two.kv_per_token * 2 == one.kv_per_token and two.weights < one.weights


def test_the_example_is_the_one_family_file_set():
    """The example needs only its declaration, config and model (core does the loading and the plan)."""
    package = Path(__file__).resolve().parents[2] / "examples" / "dgpp-example-plugin" / "src" / "dgpp_llama"
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py", "config.py", "model.py", "plugin.py"]
    assert (package / "py.typed").exists()
