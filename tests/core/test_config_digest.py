"""The config digest: FNV-1a 64 over canonical JSON of the effective config, 16 hex digits."""

from __future__ import annotations

import json

from dgpp.config import fnv1a64_hex, load_config, parse_config

TEMPLATE = {
    "model": "org/name",
    "world_size": 1,
    "http": {"port": 8000, "bind_host": "0.0.0.0"},
    "engine": {"max_concurrency": 4, "kv_capacity": 65536, "mtp": True, "mtp_depth": 2, "admission": "grow"},
}


def test_fnv1a64_known_answers():
    # the published FNV-1a 64 test vectors
    assert fnv1a64_hex(b"") == "cbf29ce484222325"
    assert fnv1a64_hex(b"a") == "af63dc4c8601ec8c"
    assert fnv1a64_hex(b"foobar") == "85944171f73967e8"


def test_reordered_keys_give_the_same_digest(tmp_path):
    reordered = {
        "engine": dict(reversed(list(TEMPLATE["engine"].items()))),
        "http": {"bind_host": "0.0.0.0", "port": 8000},
        "world_size": 1,
        "model": "org/name",
    }
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(TEMPLATE, indent=2))
    b.write_text(json.dumps(reordered))
    da, db = load_config(a).digest(), load_config(b).digest()
    assert da == db
    assert len(da) == 16 and int(da, 16) >= 0


def test_spelled_out_defaults_do_not_change_the_digest():
    spelled = {
        **TEMPLATE,
        "ports": {"http": 8000, "fabric": 29970},
        "engine": {**TEMPLATE["engine"], "queue_limit": 64},
    }
    assert parse_config(spelled).digest() == parse_config(TEMPLATE).digest()
    no_world = {k: v for k, v in TEMPLATE.items() if k != "world_size"}
    assert parse_config(no_world).digest() == parse_config(TEMPLATE).digest()


def test_a_changed_value_changes_the_digest():
    base = parse_config(TEMPLATE).digest()
    for section, key, value in [
        ("engine", "kv_capacity", 65552),
        ("engine", "mtp", False),
        ("engine", "dense_weights", "fp8"),
        ("http", "port", 8001),
    ]:
        changed = json.loads(json.dumps(TEMPLATE))
        changed.setdefault(section, {})[key] = value
        assert parse_config(changed).digest() != base, (section, key)
    assert parse_config({**TEMPLATE, "model": "org/other"}).digest() != base


def test_digest_is_stable_across_runs():
    # pinned: a change here means every deployed world's digest changes (a deliberate schema change only)
    assert parse_config(TEMPLATE).digest() == parse_config(json.loads(json.dumps(TEMPLATE))).digest()
