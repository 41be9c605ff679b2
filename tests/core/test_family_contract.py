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
from dgpp.errors import PluginError
from dgpp.family import FamilyContract, FamilyModel, World
from dgpp.family_contract import Family
from dgpp.nn.attention import PagedAttention
from dgpp.plugins import build_manager, check_contract, installed_entry_points
from dgpp.quant.resident import fp8_block_bytes
from dgpp.startup.loading import load_context, load_model
from dgpp.startup.memory_plan import plan_for
from dgpp.step.cache_spec import PagedKV
from dgpp.step.model import collect_cache_entries
from dgpp.testing.builders import build_tiny_checkpoint

pytest.importorskip("dgpp_llama", reason="the example plugin is installed by scripts/setup.sh")

TOY = FamilyModel(claims=("ToyForCausalLM",), config="toy.config:ToyConfig", model="toy.model:Toy")


def test_a_declaration_that_cannot_work_is_refused_at_registration():
    with pytest.raises(PluginError, match="loads ToyForCausalLM without the family claiming it"):
        Family(name="toy", plugin="dgpp-toy", architectures=("OtherForCausalLM",), models=(TOY,))
    with pytest.raises(PluginError, match="unknown model hooks build_everything"):
        Family(
            name="toy",
            plugin="dgpp-toy",
            architectures=("ToyForCausalLM",),
            models=(
                FamilyModel(
                    claims=TOY.claims,
                    config=TOY.config,
                    model=TOY.model,
                    hooks={"build_everything": "toy.x:f"},
                ),
            ),
        )
    with pytest.raises(PluginError, match="'toy.model.Toy' is not of the form"):
        Family(
            name="toy",
            plugin="dgpp-toy",
            architectures=("ToyForCausalLM",),
            models=(FamilyModel(claims=TOY.claims, config=TOY.config, model="toy.model.Toy"),),
        )


def test_claims_without_a_model_are_not_yet_supported():
    family = Family(
        name="toy", plugin="dgpp-toy", architectures=("ToyForCausalLM", "Toy2ForCausalLM"), models=(TOY,)
    )
    (spec,) = family.families()
    assert spec.implemented == ("ToyForCausalLM",) and spec.claims("Toy2ForCausalLM")
    assert isinstance(family, FamilyContract)


def test_every_installed_family_registers_through_the_contract():
    """Each installed family plugin's entry point names a Family, and its modules import only dgpp.plugin_api and
    dgpp.nn from core (besides the test kit and dialect blocks), apart from the few listed here with why."""
    import ast

    root = Path(__file__).resolve().parents[2]
    sources = [*sorted((root / "plugins").glob("*/src")), *sorted((root / "examples").glob("*/src"))]
    for name, ep in installed_entry_points().items():
        plugin = ep.load()
        assert isinstance(plugin, Family), f"{name} ({ep.value}) does not declare a Family"
    allowed = (
        "dgpp.plugin_api",
        "dgpp.nn",
        "dgpp.text",
        "dgpp.testing",
        "dgpp.media",
    )  # testing: the fixture builders offered; media: image preprocessing and vision-encoder pieces, as nn is
    # what a family still reads from core beside them, and why (each is a library, not the engine side)
    known = {
        "dgpp.quant.resident",  # GLM / MiMo-V2.6 / DeepSeek plans count a drafter or a release's formats themselves
        "dgpp.quant.scheme",
        "dgpp.quant.format",
        "dgpp.quant.fp8",
        "dgpp.quant.fp4",  # MiMo-V2.6's own scheme
        "dgpp.log",  # MiMo-V2.6 logs the formats its scheme picked
        "dgpp.kernels",  # MiMo's MTP attention over a paged sliding window
        "dgpp.splitmix",  # Qwen's n-gram hash derives its constants as the release does
        "dgpp.quant.encode",  # the offered tiny checkpoints of quantized releases (Flint, GLM, MiMo) pack weights
        "dgpp.quant.checkpoints",  # GLM-5.3-Flash's release fixture packs a whole checkpoint and decodes its twin
        "dgpp.quant.codecs",  # DeepSeek-V4.1's Engram decodes the FP8 + e8m0 rows it reads from the mapped table
    }
    extra: set[str] = set()
    for src in sources:
        for path in src.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                names = (
                    [module]
                    if module
                    else [a.name for a in getattr(node, "names", [])]
                    if isinstance(node, ast.Import)
                    else []
                )
                for target in names:
                    if target and target.startswith("dgpp.") and not target.startswith(allowed):
                        extra.add(target)
    assert {m for m in extra if not any(m == k or m.startswith(k + ".") for k in known)} == set(), sorted(
        extra
    )


def test_registering_the_families_imports_no_model_code():
    """Building the real plugin manager imports no family config/model module, nor torch."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys
        from dgpp.plugins import build_manager
        pm = build_manager()
        heavy = sorted(m for m in sys.modules if m.startswith("dgpp_") and not m.endswith(".plugin") and "." in m)
        print("torch" in sys.modules, heavy)
        print(sorted(i.plugin_name for i in pm.hook.dgpp_memory_plan.get_hookimpls()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "False []"
    assert all(family in out[1] for family in ("deepseek", "flint", "glm", "llama", "mimo", "qwen"))


def test_each_family_answers_only_for_itself():
    from dgpp.family import LoadContext
    from dgpp_deepseek import dialect as deepseek_dialect
    from dgpp_flint import dialect as flint_dialect
    from dgpp_qwen import dialect as qwen_dialect
    from dgpp_qwen.plugin import FAMILY as QWEN

    pm = build_manager()
    assert pm.hook.dgpp_chat_template(family="qwen", hf_config={}) == qwen_dialect.chat_template()
    v41 = {"model_type": "deepseek_v41"}
    assert pm.hook.dgpp_chat_template(family="deepseek", hf_config=v41) == deepseek_dialect.chat_template(v41)
    assert pm.hook.dgpp_chat_template(family="flint", hf_config={}) == flint_dialect.chat_template()
    other = LoadContext(Path("."), {"model_type": "qwen3"}, "glm", "Qwen3ForCausalLM")
    assert QWEN.dgpp_load_model(other) is None and QWEN.dgpp_memory_plan(other) is None
    unknown = LoadContext(Path("."), {"model_type": "qwen9"}, "qwen", "Qwen9ForCausalLM")
    assert QWEN.model_entry(unknown) is None


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
    assert all(s == PagedKV(2, 16, torch.float32, fp8_rows=True) for s in spec.values())
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
    assert (
        plan.activations_per_token
        == (8 * loaded.config.hidden_size + 3 * loaded.config.intermediate_size) * 2
    )
    if keys:
        dense = plan_for(pm, load_context(checkpoint, EngineConfig(), pm=pm)).weights
        linears = [p for n, p in loaded.named_parameters() if n.endswith("_proj.weight")]
        assert linears and dense - plan.weights == sum(
            p.numel() * 2 - fp8_block_bytes(*p.shape) for p in linears
        )


def test_the_plan_splits_kv_heads_over_ranks(tmp_path):
    checkpoint = build_tiny_checkpoint("llama", tmp_path / "llama")
    pm = build_manager()
    one = plan_for(pm, load_context(checkpoint, pm=pm))
    two = plan_for(pm, load_context(checkpoint, world=World(0, 2), pm=pm))
    assert two.kv_per_token * 2 == one.kv_per_token and two.weights < one.weights


def test_the_example_is_the_one_family_file_set():
    """The example needs only its declaration, config and model (core does the loading and the plan), and the
    offers of a family: its tiny checkpoint and its GGUF map."""
    package = Path(__file__).resolve().parents[2] / "examples" / "dgpp-example-plugin" / "src" / "dgpp_llama"
    assert sorted(p.name for p in package.glob("*.py")) == [
        "__init__.py",
        "config.py",
        "gguf_arch.py",
        "model.py",
        "plugin.py",
        "testing.py",
    ]
    assert (package / "py.typed").exists()
