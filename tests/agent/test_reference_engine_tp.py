"""The reference engine's tensor-parallel limit, enforced where its workers are started.

The engine runs a worker on one device. On a node whose GPUs are real (an NVML inventory) the
agent refuses a tensor-parallel start before spawning anything, with the status and the field
an operator can act on; a declared (CPU) node accepts it, as the e2e rebalance test does.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2
from fleetshift_agent.app import Agent
from fleetshift_agent.discovery import NVML, GpuFacts, Inventory

from .fleet import agent_config, agent_stub, kill_workers, start_request

GiB = 1024**3


def nvml_inventory(count: int) -> Inventory:
    return Inventory(
        NVML,
        tuple(
            GpuFacts(i, "NVIDIA H100 80GB HBM3", 80 * GiB, "hbm3", "9.0", True, uuid=f"GPU-{i}")
            for i in range(count)
        ),
        driver_version="550.54",
        cuda_version="12.4",
    )


@pytest.mark.parametrize(("gpus", "tp"), [((0, 1), 0), ((0, 1), 2), ((0,), 2)])
async def test_a_tensor_parallel_reference_worker_is_refused_on_real_gpus(
    tmp_path: Path, gpus: tuple[int, ...], tp: int
) -> None:
    state = tmp_path / "state"
    agent = Agent(agent_config(9, "h100-real", state), inventory=nvml_inventory(2))
    await agent.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
            stub = agent_stub(ch)
            start = start_request("w-tp", tmp_path, gpus=gpus)
            start.tensor_parallel = tp
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.StartWorker(start, timeout=10)
            info = await stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest(), timeout=10)
    finally:
        await agent.stop(0.1)
        kill_workers(state)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reference engine runs on one device" in err.value.details()
    assert "tp_options = [1]" in err.value.details()
    assert list(info.workers) == []  # nothing was spawned or recorded
    assert not list((state / "workers").glob("*.json"))
