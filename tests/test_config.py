"""Configuration: file < env < flags, and errors that name the field."""

import os
from pathlib import Path

import pytest

from extproc.config import Config, ConfigError, load_config


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


def test_the_environment_overriding_the_file_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The container image sets server.listen through the environment, which beats the
    file: a file that sets another address is overridden, and the log says so."""
    path = tmp_path / "config.yaml"
    path.write_text("server: {listen: '[::]:9002', workers: 1}\n")
    env = {"PREFIX_ROUTER_SERVER__LISTEN": "0.0.0.0:9002", "PREFIX_ROUTER_SERVER__WORKERS": "1"}
    with caplog.at_level("WARNING", logger="extproc.config"):
        cfg = load_config(path, environ=env)
    assert cfg.server.listen == "0.0.0.0:9002"
    (record,) = caplog.records
    assert "server.listen" in record.getMessage() and "[::]:9002" in record.getMessage()


def test_kubernetes_service_link_variables_are_not_settings() -> None:
    """Kubernetes gives every pod docker-link variables for each Service of its namespace;
    a Service named prefix-router (or prefix-router-anything) shares the settings' prefix,
    and its variables used to stop the router at start-up ("service_host: Extra inputs are not
    permitted"). A misspelt setting is still refused."""
    links = {
        "PREFIX_ROUTER_SERVICE_HOST": "10.96.0.12",
        "PREFIX_ROUTER_SERVICE_PORT": "9002",
        "PREFIX_ROUTER_SERVICE_PORT_GRPC": "9002",
        "PREFIX_ROUTER_PORT": "tcp://10.96.0.12:9002",
        "PREFIX_ROUTER_PORT_9002_TCP": "tcp://10.96.0.12:9002",
        "PREFIX_ROUTER_PORT_9002_TCP_PROTO": "tcp",
        "PREFIX_ROUTER_PORT_9002_TCP_PORT": "9002",
        "PREFIX_ROUTER_PORT_9002_TCP_ADDR": "10.96.0.12",
        "PREFIX_ROUTER_METRICS_SERVICE_HOST": "10.96.0.13",
        "PREFIX_ROUTER_METRICS_PORT_9003_UDP_ADDR": "10.96.0.13",
    }
    cfg = load_config(environ={**links, "PREFIX_ROUTER_SERVER__WORKERS": "2"})
    assert cfg.server.workers == 2
    with pytest.raises(ConfigError, match="servce_host"):
        load_config(environ={"PREFIX_ROUTER_SERVCE_HOST": "x"})


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
        ({"server.worker_hang_seconds": 4}, "server.worker_hang_seconds"),
        ({"models.unknown_wait_seconds": 1.0}, "models.unknown_wait_seconds"),
        ({"warm_start.path": "/var/lib/prefix-router/"}, "warm_start.path"),
        ({"warm_start.max_age_seconds": 0}, "warm_start.max_age_seconds"),
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


def test_a_warm_start_file_the_router_cannot_keep_stops_it_at_start(tmp_path, capsys):
    """warm_start.path is checked where the router runs (a ConfigMap is checked elsewhere):
    a missing or unwritable directory, or a directory named, stop `serve` with exit code 2,
    with --workers N too (before any worker starts)."""
    from extproc.cli import main

    for path, why in (
        (tmp_path / "missing" / "index.snapshot", "does not exist"),
        (tmp_path, "is a directory"),
    ):
        assert main(["serve", "--set", f"warm_start.path={path}"]) == 2
        err = capsys.readouterr().err
        assert "warm_start.path" in err and why in err
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # (root writes anywhere)
        assert main(["serve", "--set", f"warm_start.path={locked / 'index'}"]) == 2
        assert "not writable" in capsys.readouterr().err
    missing = tmp_path / "missing" / "index"
    assert main(["serve", "--workers", "2", "--set", f"warm_start.path={missing}"]) == 2
    err = capsys.readouterr().err
    assert "warm_start.path" in err and "does not exist" in err


def test_each_worker_has_an_index_file_of_its_own(tmp_path):
    """With --workers N each worker writes and reads warm_start.path + '.worker-K' (K its
    slot, which a worker started again in a dead one's place keeps); the rest is the same."""
    from extproc.serve import worker_config_data

    path = str(tmp_path / "index")
    data = load_config(None, {"server.workers": 2, "warm_start.path": path}).model_dump(mode="json")
    workers = [Config.model_validate(worker_config_data(data, slot)) for slot in (0, 1)]
    assert [w.warm_start.path for w in workers] == [f"{path}.worker-0", f"{path}.worker-1"]
    assert workers[1].model_dump(exclude={"warm_start"}) == Config.model_validate(data).model_dump(
        exclude={"warm_start"}
    )
    assert data["warm_start"]["path"] == path  # (the supervisor's own is left as it is)
    none = load_config(None, {"server.workers": 2}).model_dump(mode="json")
    assert worker_config_data(none, 1) == none
