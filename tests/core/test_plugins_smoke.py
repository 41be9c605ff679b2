from dgpp.plugins import build_manager, families


def test_in_tree_plugins_are_discovered():
    names = {f.name for f in families(build_manager())}
    assert {"qwen", "glm", "deepseek", "mimo", "flint"} <= names
