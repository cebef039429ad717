"""FetchSnapshot between two agents: over mTLS with each agent's own node certificate, and
under a retention policy that must never delete the snapshot a fetch just brought in.

No daemon is needed: the agents serve while they retry registering, and the test calls the
destination agent as the daemon would.
"""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import grpc
import torch

from fleetshift.v1 import agent_pb2
from fleetshift_agent.snapshot import SnapshotStore
from fleetshift_rpc import pki
from tests.snapshot.helpers import make_key

from .fleet import agent_config, agent_stub, running_agent

KEY = make_key(model_id="tiny", weights_digest="sha256:" + "cd" * 32, dtype="float32")


def _write(store: SnapshotStore, snapshot_id: str, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    store.write(
        snapshot_id,
        key=KEY,
        spec={"kind": "test"},
        tensor_groups={"weights": {"w": torch.randn(256, 256, generator=g)}},
        json_parts={"sessions": []},
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_fetch_snapshot_over_mtls(tmp_path: Path) -> None:
    home = tmp_path / "pki"
    pki.init_ca(home)
    loopback = {"san_ips": ["127.0.0.1"]}
    nodes = {n: pki.issue(home, "node", n, **loopback) for n in ("node-a", "node-b")}  # type: ignore[arg-type]
    caller = pki.issue(home, "daemon", "fleetshiftd", **loopback)  # type: ignore[arg-type]
    ca = home / pki.CA_CERT
    nowhere = _free_port()  # no daemon: registration keeps failing, serving does not

    def config(name: str) -> object:
        plain = agent_config(nowhere, name, tmp_path / name)
        pair = nodes[name]
        return dataclasses.replace(
            plain, tls_cert=str(pair.cert), tls_key=str(pair.key), tls_ca=str(ca)
        )

    async with (
        running_agent(config("node-a")) as a,  # type: ignore[arg-type]
        running_agent(config("node-b")) as b,  # type: ignore[arg-type]
    ):
        assert a.store is not None and b.store is not None
        _write(a.store, "snap-tls")
        creds = grpc.ssl_channel_credentials(
            ca.read_bytes(), caller.key.read_bytes(), caller.cert.read_bytes()
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{b.port}", creds) as ch:
            reply = await agent_stub(ch).FetchSnapshot(
                agent_pb2.FetchSnapshotRequest(
                    source_agent_address=f"127.0.0.1:{a.port}", snapshot_id="snap-tls"
                ),
                timeout=30,
            )
        assert reply.bytes_received >= 256 * 256 * 4
        fetched = SnapshotStore(Path(b.config.state_dir) / "snapshots").get("snap-tls")
        fetched.verify()
        assert fetched.key == KEY
        assert torch.equal(
            fetched.load_tensors("weights")["w"],
            a.store.get("snap-tls").load_tensors("weights")["w"],
        )


async def test_retention_keeps_what_a_fetch_just_brought_in(tmp_path: Path) -> None:
    nowhere = _free_port()
    source = agent_config(nowhere, "node-a", tmp_path / "a")
    keep_one = dataclasses.replace(
        agent_config(nowhere, "node-b", tmp_path / "b"), snapshot_keep_last_per_model=1
    )
    async with running_agent(source) as a, running_agent(keep_one) as b:
        assert a.store is not None and b.store is not None
        _write(a.store, "older", seed=1)
        _write(a.store, "newer", seed=2)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as ch:
            stub = agent_stub(ch)

            async def fetch(snapshot_id: str) -> set[str]:
                await stub.FetchSnapshot(
                    agent_pb2.FetchSnapshotRequest(
                        source_agent_address=f"127.0.0.1:{a.port}", snapshot_id=snapshot_id
                    )
                )
                return {s.snapshot_id for s in b.store.list()}  # type: ignore[union-attr]

            assert await fetch("older") == {"older"}
            assert await fetch("newer") == {"newer"}  # one per model: the older one goes
            # fetched again, the older snapshot stays: the daemon is about to restore it
            assert await fetch("older") == {"newer", "older"}
