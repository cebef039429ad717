"""Config files and environment overrides: what an operator types, and the errors they get."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_common.config import ConfigError, EngineArgs, agent_config, daemon_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_and_file_values(tmp_path: Path) -> None:
    cfg = daemon_config(write(tmp_path, 'listen = "0.0.0.0:6000"\nnode_lost_after_s = 30\n'), {})
    assert cfg.listen == "0.0.0.0:6000"
    assert cfg.node_lost_after_s == 30.0
    assert cfg.effective_database_url == "sqlite:////var/lib/fleetshift/fleetshift.db"


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "heartbeat_interval_s = 1\n")
    env = {
        "FLEETSHIFTD_HEARTBEAT_INTERVAL_S": "0.5",
        "FLEETSHIFTD_DATABASE_URL": "postgresql://u@db/fleet",
    }
    cfg = daemon_config(path, env)
    assert cfg.heartbeat_interval_s == 0.5
    assert cfg.effective_database_url == "postgresql://u@db/fleet"


@pytest.mark.parametrize(
    ("text", "env", "named"),
    [
        ('listn = "1.2.3.4:5"\n', {}, "listn"),
        ('heartbeat_interval_s = "fast"\n', {}, "heartbeat_interval_s"),
        ("node_lost_after_s = -1\n", {}, "node_lost_after_s"),
        ('listen = "nohost"\n', {}, "listen"),
        ("", {"FLEETSHIFTD_MAX_MESSAGE_BYTES": "lots"}, "FLEETSHIFTD_MAX_MESSAGE_BYTES"),
        ("heartbeat_interval_s = 5\nnode_lost_after_s = 4\n", {}, "node_lost_after_s"),
        ("not toml [", {}, "config"),
    ],
)
def test_bad_daemon_config_names_the_key(
    tmp_path: Path, text: str, env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError) as err:
        daemon_config(write(tmp_path, text), env)
    assert err.value.field == named
    assert named in str(err.value) or named == "config"


def test_agent_declared_gpus(tmp_path: Path) -> None:
    text = (
        'node_name = "n1"\ninventory = "declared"\n'
        '[[gpus]]\nproduct_name = "NVIDIA H100 80GB HBM3"\ncount = 2\n'
    )
    cfg = agent_config(write(tmp_path, text), {})
    assert cfg.gpus[0].count == 2
    assert cfg.gpus[0].product_name == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('inventory = "declared"\n', "gpus"),
        ('[[gpus]]\nproduct_name = "H100"\ncolour = "red"\n', "gpus[0].colour"),
        ('[[gpus]]\nproduct_name = "H100"\ncount = 0\n', "gpus.count"),
        ("[[gpus]]\ncount = 2\n", "gpus[0]"),
        ('inventory = "guess"\n', "inventory"),
        ('listen = "0.0.0.0:50052"\n', "advertise_address"),
        ('listen = "[::]:50052"\n', "advertise_address"),
        ('worker_host = "10.0.0.7:9000"\n', "worker_host"),
        ('worker_host = "0.0.0.0"\n', "worker_host"),
        ("worker_session_callers = 3\n", "worker_session_callers"),
    ],
)
def test_bad_agent_config_names_the_key(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        agent_config(write(tmp_path, text), {})
    assert err.value.field == named


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        daemon_config(tmp_path / "absent.toml", {})


def test_a_models_engine_and_its_arguments(tmp_path: Path) -> None:
    text = (
        '[[models]]\nname = "m"\npreset = "llama2-7b"\n'
        '[[models]]\nname = "v"\npreset = "llama2-7b"\nengine = "vllm"\n'
        "[models.engine_args]\nmax_model_len = 512\nenforce_eager = false\n"
        'kv_connector = "ExampleConnector"\nextra_args = ["--max-num-seqs", "8"]\n'
    )
    cfg = daemon_config(write(tmp_path, text), {})
    plain, vllm = cfg.models
    assert (plain.engine, plain.engine_args) == ("reference", EngineArgs())
    assert vllm.engine == "vllm"
    assert vllm.engine_args.max_model_len == 512 and not vllm.engine_args.enforce_eager
    assert vllm.engine_args.extra_args == ("--max-num-seqs", "8")
    # What the daemon sends the agent reads back the same.
    assert EngineArgs.from_json(vllm.engine_args.to_json()) == vllm.engine_args


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ('engine = "sglang"\n', "unknown engine 'sglang'"),
        ("[models.engine_args]\nmax_model_len = -1\n", "engine_args.max_model_len"),
        ("[models.engine_args]\nkv_cache_gib = 0\n", "engine_args.kv_cache_gib"),
        ("[models.engine_args]\nblock_size = 16\n", "models[0].engine_args.block_size"),
    ],
)
def test_a_bad_engine_is_named(tmp_path: Path, model: str, named: str) -> None:
    text = '[[models]]\nname = "m"\npreset = "llama2-7b"\n' + model
    with pytest.raises(ConfigError) as err:
        daemon_config(write(tmp_path, text), {})
    assert named in err.value.message


@pytest.mark.parametrize(
    ("text", "host"),
    [
        ("", "127.0.0.1"),  # the loopback development default, as before
        ('listen = "198.18.0.11:50052"\n', "198.18.0.11"),
        (
            'listen = "0.0.0.0:50052"\nadvertise_address = "h100-7.fleet.lan:50052"\n',
            "h100-7.fleet.lan",
        ),
        ('listen = "10.0.0.7:50052"\nworker_host = "192.0.2.7"\n', "192.0.2.7"),
        ('worker_host = "[2001:db8::7]"\n', "2001:db8::7"),
    ],
)
def test_workers_listen_where_peers_reach_the_node(tmp_path: Path, text: str, host: str) -> None:
    """Workers bind and report the node's address: worker_host, else the advertised host."""
    assert agent_config(write(tmp_path, text), {}).effective_worker_host == host
