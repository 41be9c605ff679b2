"""The original engine's template keys this engine does not build are refused by name with the reason, through
the template's error path (``dgpp check`` and ``dgpp serve`` alike); none is accepted and ignored."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dgpp.config import DeployConfig, EngineConfig, parse_config
from dgpp.config_refused import NOT_BUILT_KEYS, NOT_BUILT_VALUES
from dgpp.errors import ConfigError
from dgpp.startup.kv_format import refuse_unstored_kv


def _with(path: tuple[str, ...], value: object) -> dict:
    raw: dict = {"model": "m"}
    node = raw
    for key in path[:-1]:
        node = node.setdefault(key, {})
    if path[:2] == ("engine", "rope_scaling"):  # the refused key sits beside rope_scaling's required ones
        node.update({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096})
    node[path[-1]] = value
    return raw


@pytest.mark.parametrize("path", sorted(NOT_BUILT_KEYS), ids=".".join)
def test_a_key_that_is_not_built_is_refused_by_name_with_its_reason(path) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(_with(path, 1), source="t.json")
    message = str(err.value)
    assert message.startswith(f"t.json: {'.'.join(path)}: not built in this engine (")
    assert NOT_BUILT_KEYS[path] in message and "unknown key" not in message


def test_a_value_that_is_not_built_is_refused_by_name(monkeypatch) -> None:
    """Every listed value, and a value listed for a built key (none is listed now: the mechanism stays checked)."""
    monkeypatch.setitem(NOT_BUILT_VALUES, ("engine", "kv_dtype"), {"fp6": "no cache stores fp6"})
    for path, values in NOT_BUILT_VALUES.items():
        for value, why in values.items():
            with pytest.raises(
                ConfigError, match=f"{'.'.join(path)}: '{value}' is not built in this engine"
            ) as err:
                parse_config(_with(path, value))
            assert why in str(err.value)


def test_no_refused_key_is_in_the_schema() -> None:
    """A refused key comes back into the schema with its feature, and then leaves the refused list."""
    for path in NOT_BUILT_KEYS:
        node: type | None = DeployConfig
        for key in path[:-1]:
            fields = {f.encode_name: f.type for f in msgspec.structs.fields(node)} if node else {}
            t = fields.get(key)
            node = next(
                (
                    a
                    for a in getattr(t, "__args__", (t,))
                    if isinstance(a, type) and issubclass(a, msgspec.Struct)
                ),
                None,
            )
        names = {f.encode_name for f in msgspec.structs.fields(node)} if node else set()
        assert path[-1] not in names, path


def test_several_refused_keys_are_named_in_one_message() -> None:
    with pytest.raises(ConfigError, match=r"engine\.mtp_draft: not built.*; engine\.fp8_head: not built"):
        parse_config({"model": "m", "engine": {"mtp_draft": "sampled", "fp8_head": "gemv"}})


def test_bf16_kv_must_match_the_compute_dtype() -> None:
    refuse_unstored_kv(EngineConfig(kv_dtype="bf16"), torch.bfloat16)
    with pytest.raises(ConfigError, match="engine.kv_dtype: 'bf16' is not the compute dtype, float32"):
        refuse_unstored_kv(EngineConfig(kv_dtype="bf16"), torch.float32)
    refuse_unstored_kv(EngineConfig(), torch.float32)  # auto is always fine
