"""Typed config: defaults, YAML + env overrides, and errors that name the field."""

import pytest

from services.common.config import ConfigError
from services.config import load_config


def test_defaults_are_valid():
    config = load_config(environ={})
    assert config.router.default_max_tokens > 0
    assert config.etcd.prefix == "/ballast/"


def test_yaml_then_env_override(tmp_path):
    path = tmp_path / "ballast.yaml"
    path.write_text("router:\n  port: 6000\nauth:\n  api_keys: {k1: acme}\n")
    config = load_config(path, environ={"BALLAST__ROUTER__PORT": "7000", "BALLAST__WORKER__POOL": "light"})
    assert config.router.port == 7000
    assert config.worker.pool == "light"
    assert config.auth.api_keys == {"k1": "acme"}


def test_env_json_values(tmp_path):
    config = load_config(environ={"BALLAST__AUTH__ENABLED": "false", "BALLAST__AUTH__API_KEYS": '{"a": "t"}'})
    assert config.auth.enabled is False
    assert config.auth.api_keys == {"a": "t"}


@pytest.mark.parametrize(
    "env, field",
    [
        ({"BALLAST__ROUTER__PORT": "not-a-port"}, "router.port"),
        ({"BALLAST__ETCD__LEASE_TTL_S": "1"}, "etcd.lease_ttl_s"),
        ({"BALLAST__ETCD__PREFIX": "ballast"}, "etcd.prefix"),
        ({"BALLAST__ROUTER__NO_SUCH_FIELD": "1"}, "router.no_such_field"),
    ],
)
def test_bad_values_name_the_field(env, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(environ=env)


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})


def test_shipped_local_config_is_valid():
    config = load_config("deploy/local/ballast.yaml", environ={})
    assert config.auth.enabled and config.auth.api_keys
