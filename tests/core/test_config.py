"""Deployment templates: every class of error names the key's path; defaults and knobs."""

from __future__ import annotations

import json

import pytest

from dgpp.config import DeployConfig, apply_knobs, load_config, parse_config
from dgpp.errors import ConfigError


def error_of(raw) -> str:
    with pytest.raises(ConfigError) as exc:
        parse_config(raw)
    return str(exc.value)


def test_defaults_are_the_original_engines():
    cfg = parse_config({"model": "org/name"})
    assert isinstance(cfg, DeployConfig)
    assert cfg.world == 1 and cfg.world_size == 1
    assert (cfg.http.bind_host, cfg.http.port, cfg.http.max_body_bytes, cfg.http.sse_ping_interval) == (
        "127.0.0.1",
        18080,
        16777216,  # 16 MiB, not the original's 256 MiB: a body is held whole in memory before it is parsed
        30,
    )
    assert (cfg.http.body_timeout_s, cfg.http.api_key, cfg.http.api_key_env, cfg.http.cors_origins) == (
        30.0,
        "",
        "",
        [],
    )
    assert (cfg.ports.http, cfg.ports.fabric, cfg.ports.journal) == (18080, 29970, 29971)
    e = cfg.engine
    assert (e.max_concurrency, e.kv_capacity, e.default_max_tokens, e.queue_limit, e.max_connections) == (
        8,
        8192,
        256,
        64,
        64,
    )
    assert (
        e.prefix_cache_gib,
        e.prefix_min_tokens,
        e.admission,
        e.admission_window,
        e.admission_gather_ms,
        e.admission_gather_max_ms,
    ) == (1.5, 1024, "full", 256, 3, 0)
    assert (e.prefill_budget_tokens, e.prefill_idle_budget_tokens) == (-1, 0)
    assert (e.block_size, e.dtype, e.kv_dtype, e.bf16_weights, e.dense_weights) == (
        16,
        "auto",
        "auto",
        "checkpoint",
        "checkpoint",
    )
    assert not e.mtp and e.mtp_depth == 1 and e.lossy_levers() == []


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"model": "m", "engine": {"max_concurency": 4}},
            "engine.max_concurency: unknown key (did you mean max_concurrency?)",
        ),
        ({"model": "m", "htp": {}}, "htp: unknown key"),
        (
            {
                "model": "m",
                "engine": {"rope_scaling": {"factor": 2, "original_max_position_embeddings": 8, "beta": 1}},
            },
            "engine.rope_scaling.beta: unknown key",
        ),
    ],
)
def test_unknown_keys_are_named(raw, expected):
    assert expected in error_of(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"model": "m", "engine": {"mtp": "yes"}}, "engine.mtp: wrong type: expected bool, got str"),
        (
            {"model": "m", "engine": {"kv_capacity": 1.5}},
            "engine.kv_capacity: wrong type: expected int, got float",
        ),
        ({"model": 7}, "model: wrong type: expected str, got int"),
        ({"model": "m", "nodes": "a,b"}, "nodes: wrong type: expected array"),
        ({"model": "m", "engine": []}, "engine: wrong type: expected object, got array"),
    ],
)
def test_wrong_types_are_named(raw, expected):
    assert expected in error_of(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            {"model": "m", "engine": {"kv_capacity": 0}},
            "engine.kv_capacity: out of range: expected int >= 1, got 0",
        ),
        (
            {"model": "m", "engine": {"mtp_depth": 17}},
            "engine.mtp_depth: out of range: expected int <= 16, got 17",
        ),
        ({"model": "m", "http": {"port": 70000}}, "http.port: out of range"),
        ({"model": "m", "http": {"sse_ping_interval": 0}}, "http.sse_ping_interval: out of range"),
        (
            {"model": "m", "engine": {"kv_dtype": "int3"}},
            'engine.kv_dtype: invalid value "int3" (allowed: auto, bf16, fp4, fp8)',
        ),
        ({"model": "m", "engine": {"admission": "lazy"}}, "engine.admission: invalid value"),
        ({"model": "m", "engine": {"block_size": 12}}, "engine.block_size: 12 is not a power of two"),
        ({"model": ""}, "model: out of range"),
        ({"model": "m", "world_size": 0}, "world_size: out of range"),
    ],
)
def test_out_of_range_values_are_named(raw, expected):
    assert expected in error_of(raw)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({}, "model: required key missing"),
        (
            {"model": "m", "engine": {"rope_scaling": {"factor": 2}}},
            "engine.rope_scaling.original_max_position_embeddings: required key missing",
        ),
        ({"model": "m", "world_size": 2, "nodes": ["a", "b"]}, "world_size, nodes: mutually exclusive"),
        (
            {"model": "m", "ports": {"fabric": 4000, "journal": 4000}},
            "ports.fabric, ports.journal: must differ",
        ),
        ({"model": "m", "ports": {"http": 9000}}, "ports.http, http.port: disagree"),
        (
            {"model": "m", "node_env": [{"AWS_SECRET": "x"}]},
            "node_env[0].AWS_SECRET: not an allowed variable",
        ),
        ({"model": "m", "nodes": ["a", "b"], "node_env": [{}]}, "node_env: 1 entries for 2 ranks"),
        (
            {"model": "m", "http": {"bind_host": "example.com"}},
            "http.bind_host: 'example.com' is not an IPv4 address",
        ),
        (
            {"model": "m", "engine": {"prefill_budget_tokens": 512, "prefill_idle_budget_tokens": 256}},
            "engine.prefill_idle_budget_tokens: 256 is below",
        ),
    ],
)
def test_missing_and_conflicting_keys_are_named(raw, expected):
    assert expected in error_of(raw)


def test_a_template_file_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "m",\n "engine": {"kv_capacity": }}')
    with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON: .* line 2"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"absent\.json: deployment template not found"):
        load_config(tmp_path / "absent.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(tmp_path / "list.json")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"model": "m", "engine": {"max_concurency": 1}}))
    with pytest.raises(ConfigError, match=r"unknown\.json: engine\.max_concurency: unknown key"):
        load_config(unknown)


def test_nodes_give_the_world_and_yarn_validates():
    cfg = parse_config(
        {
            "model": "m",
            "nodes": ["spark1", "spark2"],
            "node_env": [{"HF_HUB_CACHE": "/x"}, {}],
            "engine": {
                "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 262144}
            },
        }
    )
    assert cfg.world == 2 and cfg.world_size is None
    assert cfg.engine.rope_scaling.factor == 2.0 and cfg.engine.rope_scaling.beta_fast == 32.0


def test_knobs_override_engine_keys_and_are_validated_like_the_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps(
            {
                "model": "m",
                "ports": {"http": 8000},
                "http": {"port": 8000},
                "engine": {"mtp": True, "mtp_depth": 3},
            }
        )
    )
    cfg = load_config(
        path, {"mtp": False, "kv_capacity": 4096, "port": 9000, "host": "0.0.0.0", "kv_dtype": "bf16"}
    )
    assert (cfg.engine.mtp, cfg.engine.mtp_depth, cfg.engine.kv_capacity, cfg.engine.kv_dtype) == (
        False,
        3,
        4096,
        "bf16",
    )
    assert load_config(path, {"kv_dtype": "fp4"}).engine.lossy_levers() == ["kv_dtype"]
    assert load_config(path, {"kv_dtype": "fp8"}).engine.lossy_levers() == ["kv_dtype"]
    assert (cfg.http.port, cfg.ports.http, cfg.http.bind_host) == (9000, 9000, "0.0.0.0")
    with pytest.raises(ConfigError, match="engine.max_concurrency: out of range: expected int >= 1, got 0"):
        load_config(path, {"max_concurrency": 0})
    with pytest.raises(ConfigError, match="--model: model is a topology/model key"):
        apply_knobs({"model": "m"}, {"model": "other"})
    with pytest.raises(ConfigError, match="--queue-limit: not a knob"):
        apply_knobs({"model": "m"}, {"queue_limit": 3})


def test_non_finite_numbers_are_refused(tmp_path):
    assert "engine.prefix_cache_gib: inf is not a finite number" in error_of(
        {"model": "m", "engine": {"prefix_cache_gib": float("inf")}}
    )
    path = tmp_path / "nan.json"
    path.write_text('{"model": "m", "engine": {"stats_interval_s": NaN}}')
    with pytest.raises(ConfigError, match="nan.json: not valid JSON: NaN is not a JSON number"):
        load_config(path)
