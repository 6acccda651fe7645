"""Configuration: file < env < flags, and errors that name the field."""

import pytest

from extproc.config import ConfigError, load_config


def test_defaults_are_valid():
    cfg = load_config(environ={})
    assert cfg.server.listen == "127.0.0.1:9002"
    assert cfg.server.body_mode == "buffered"
    assert cfg.routing.block_size_bytes == 64
    assert cfg.endpoints == ()


def test_file_then_env_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "server: {workers: 2, listen: '127.0.0.1:7000'}\n"
        "endpoints:\n  - {address: '127.0.0.1:8001', capacity_tokens: 1000}\n  - '127.0.0.1:8002'\n"
    )
    env = {"PREFIX_ROUTER_SERVER__WORKERS": "3", "PREFIX_ROUTER_ROUTING__STICKINESS": "0.1"}
    cfg = load_config(path, {"server.listen": "127.0.0.1:7001"}, environ=env)
    assert cfg.server.workers == 3
    assert cfg.server.listen == "127.0.0.1:7001"
    assert cfg.routing.stickiness == 0.1
    assert [e.address for e in cfg.endpoints] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    assert cfg.endpoints[0].capacity_tokens == 1000


def test_endpoints_from_a_comma_string_and_ipv6():
    cfg = load_config(overrides={"endpoints": "127.0.0.1:1, [::1]:2"}, environ={})
    assert [e.address for e in cfg.endpoints] == ["127.0.0.1:1", "[::1]:2"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"routing.block_size_bytes": 0}, "routing.block_size_bytes"),
        ({"server.body_mode": "streamed"}, "server.body_mode"),
        ({"server.workers": 0}, "server.workers"),
        ({"server.listen": "localhost:80"}, "server.listen"),
        ({"endpoints": "model-server:8000"}, "endpoints.0.address"),
        ({"endpoints": "127.0.0.1:1,127.0.0.1:1"}, "endpoints"),
        ({"routing.typo_field": 1}, "routing.typo_field"),
        ({"server.header_name": "has space"}, "server.header_name"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides, environ={})
    assert f"config field {field}" in str(info.value)


def test_unreadable_or_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad, environ={})


def test_cli_rejects_invalid_config_with_exit_code_2(capsys):
    from extproc.cli import main

    assert main(["serve", "--set", "routing.block_size_bytes=-1"]) == 2
    assert "routing.block_size_bytes" in capsys.readouterr().err
