"""Replica settings and replica lists in configuration: bad values are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetshift_common.config import ConfigError, agent_config, daemon_config


def test_replica_timings_must_leave_the_leader_time_to_stop(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text("[replicas]\nlease_ttl_s = 3.0\nrenew_deadline_s = 3.0\n")
    with pytest.raises(ConfigError, match="renew_deadline_s < lease_ttl_s") as err:
        daemon_config(path, env={})
    assert err.value.field == "replicas"
    path.write_text("[replicas]\nlease_ttl_s = 10.0\nrenew_deadline_s = 6.0\n")
    assert daemon_config(path, env={}).replicas.renew_deadline_s == 6.0


@pytest.mark.parametrize("key", ["view_refresh_s", "view_full_read_s"])
def test_a_followers_read_intervals_must_be_positive(tmp_path: Path, key: str) -> None:
    path = tmp_path / "d.toml"
    path.write_text(f"[replicas]\n{key} = 0\n")
    with pytest.raises(ConfigError, match=f"replicas.{key}") as err:
        daemon_config(path, env={})
    assert err.value.field == f"replicas.{key}"
    path.write_text(f"[replicas]\n{key} = 30.0\n")
    assert getattr(daemon_config(path, env={}).replicas, key) == 30.0


def test_an_agent_takes_every_replica_and_names_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "a.toml"
    base = 'inventory = "declared"\n[[gpus]]\nproduct_name = "NVIDIA H200"\ncount = 1\n'
    path.write_text('daemon_address = "10.0.0.1:50051, 10.0.0.2:50051"\n' + base)
    assert agent_config(path, env={}).daemon_address == "10.0.0.1:50051, 10.0.0.2:50051"
    path.write_text('daemon_address = "10.0.0.1:50051,nope"\n' + base)
    with pytest.raises(ConfigError, match=r"daemon_address.*'nope'"):
        agent_config(path, env={})
