"""Router config: the embedded default parses, and every invalid config fails at load naming its key."""

from __future__ import annotations

import pytest

from backends.default_model import DEFAULT_DRAFTERS, DEFAULT_MODEL
from router.config import load_config
from router.errors import ConfigError
from tests.test_router_support import config_data, write_config


def test_embedded_default_parses_and_names_its_pools(monkeypatch):
    monkeypatch.delenv("DSPARK_ROUTER_MODEL", raising=False)
    config = load_config(check_paths=False)
    assert set(config.pools) == {"dspark", "standard"}
    assert config.pools["dspark"].backend == "dspark"
    assert config.pools["standard"].backend == "autoregressive"
    assert {p.model for p in config.pools.values()} == {str(DEFAULT_MODEL)}
    assert config.pools["dspark"].drafter_path == str(DEFAULT_DRAFTERS)
    assert config.redis_url is None


def test_model_env_var_overrides_the_default_model(monkeypatch, tmp_path):
    """Another model carries its own drafters (or none): the default model's are not pointed at it."""
    monkeypatch.setenv("DSPARK_ROUTER_MODEL", str(tmp_path))
    config = load_config(check_paths=False)
    assert {p.model for p in config.pools.values()} == {str(tmp_path)}
    assert config.pools["dspark"].drafter_path is None


def test_the_default_model_is_spelled_once(tmp_path):
    """``model: default`` and ``drafter_path: default`` in any config, wherever it lies, name the one definition."""
    data = config_data({"dspark": "default", "standard": "default"})
    data["pools"]["dspark"]["drafter_path"] = "default"
    config = load_config(write_config(tmp_path / "r.yaml", data), check_paths=False)
    assert {p.model for p in config.pools.values()} == {str(DEFAULT_MODEL)}
    assert config.pools["dspark"].drafter_path == str(DEFAULT_DRAFTERS)


def test_relative_model_paths_resolve_against_the_config_file(tmp_path):
    data = config_data({"dspark": "models/a", "standard": "models/b"})
    config = load_config(write_config(tmp_path / "r.yaml", data), check_paths=False)
    assert config.pools["dspark"].model == str(tmp_path / "models" / "a")


def _set(data: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[last] = value
    return data


RULE = {"name": "json", "pool": "dspark", "match": {"tools": True}}
BAD = [
    ("pools.dspark.wrokers", 2, "pools.dspark.wrokers"),
    ("pools.dspark.workers", 0, "pools.dspark.workers"),
    ("pools.dspark.backend", "vllm", "pools.dspark.backend"),
    ("pools.standard.decoding", {"max_span": 2}, "pools.standard.decoding"),
    ("pools.dspark.api_base", "http://x", "pools.dspark.api_base"),
    ("pools.dspark.decoding", {"max_span": 99}, "pools.dspark.decoding.max_span"),
    ("pools.dspark.decoding", {"drafter": "dspark"}, "pools.dspark.decoding"),  # pools.dspark.drafter chooses it
    ("pools.dspark.device", "tpu", "pools.dspark.device"),
    ("pools.dspark.transport", "redis", "pools.dspark.transport"),  # no redis_url on the pool or at the top
    ("pools.dspark.redis", {"heartbeat_s": 5, "visibility_timeout_s": 10}, "pools.dspark.redis"),
    ("pools.dspark.health", {"allowed_fails": 0}, "pools.dspark.health.allowed_fails"),
    ("pools.standard.max_tokens", 0, "pools.standard.max_tokens"),
    ("pools.standard.defaults", {"temperature": 3}, "pools.standard.defaults.temperature"),
    ("policy.defaults", {"top_p": 0}, "policy.defaults.top_p"),
    ("policy.threshold", 1.5, "policy.threshold"),
    ("policy.explore", 0.9, "policy.explore"),
    ("policy.default_pool", "gpu", "policy.default_pool"),
    ("policy.overflow", {"dspark": "nowhere"}, "policy.overflow.dspark"),
    ("policy.fallback", {"dspark": "dspark"}, "policy.fallback.dspark"),
    ("policy.rules", [{**RULE, "pool": "nowhere"}], "policy.rules.0.pool"),
    (
        "policy.rules",
        [RULE, {**RULE, "name": "re", "match": {"prompt_regex": "(unclosed"}}],
        "policy.rules.1.match.prompt_regex",
    ),
    ("policy.rules", [{**RULE, "match": {}}], "policy.rules.0.match"),
    ("policy.rules", [{**RULE, "name": "classifier"}], "policy.rules.0.name"),
    ("policy.rules", [RULE, RULE], "policy.rules.1.name"),
    (
        "policy.rules",
        [{**RULE, "match": {"temperature": {"min": 1.0, "max": 0.5}}}],
        "policy.rules.0.match.temperature",
    ),
    ("policy.tenants", {"acme": {"rules": [{**RULE, "pool": "x"}]}}, "policy.tenants.acme.rules.0.pool"),
    ("log.redis_stream", "decisions", "log.redis_stream"),
    ("pools.dspark.model", "${DSPARK_TEST_UNSET_VARIABLE}", "pools.dspark.model"),
]


@pytest.mark.parametrize(("dotted", "value", "key"), BAD, ids=[b[0] + "=" + str(b[1])[:20] for b in BAD])
def test_invalid_config_names_the_key(tmp_path, dotted, value, key):
    data = _set(config_data({"dspark": tmp_path, "standard": tmp_path}), dotted, value)
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path / "bad.yaml", data), check_paths=False)
    assert info.value.param == key
    assert key in str(info.value)
    assert info.value.to_openai()["error"]["type"] == "config_error"


def test_missing_model_folder_is_named_at_load(tmp_path):
    data = config_data({"dspark": tmp_path / "gone", "standard": tmp_path})
    with pytest.raises(ConfigError, match=r"pools\.dspark\.model"):
        load_config(write_config(tmp_path / "r.yaml", data))


@pytest.mark.parametrize(
    ("text", "message"),
    [("pools: [unclosed", "not valid YAML"), ("- just\n- a list\n", "must be a mapping"), ("policy: {}\n", "pools")],
)
def test_unreadable_configs_fail_clearly(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.yaml")


def test_a_redis_pool_takes_the_top_level_url_and_needs_no_model_here(tmp_path):
    data = config_data({"dspark": "models/absent", "standard": "models/absent"})
    data["pools"]["dspark"]["transport"] = "redis"
    data["redis_url"] = "redis://127.0.0.1:6399/2"
    with pytest.raises(ConfigError, match=r"pools\.standard\.model"):  # the in-process pool loads here
        load_config(write_config(tmp_path / "r.yaml", data))
    data["pools"]["standard"]["transport"] = "redis"
    config = load_config(write_config(tmp_path / "r.yaml", data))  # the workers load the models, not the router
    assert {pool.redis_url for pool in config.pools.values()} == {"redis://127.0.0.1:6399/2"}
