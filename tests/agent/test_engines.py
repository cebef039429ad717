"""The agent's engine boundary without vLLM installed: what it says it can run, and the
refusals of an engine it does not know or cannot run here, each before any process starts.
(The vLLM tier, tests/vllm, runs real vLLM workers.)"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import grpc
import pytest

from fleetshift.v1 import agent_pb2

from .fleet import agent_config, agent_stub, running_agent, start_request


async def test_unknown_or_unavailable_engines_are_refused_by_name(
    daemon: object, tiny_model: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    # This interpreter (the dev environment) has no vLLM: the agent must say so.
    config = dataclasses.replace(
        agent_config(daemon.port, "cpu-e", state),  # type: ignore[attr-defined]
        vllm_python=sys.executable,
    )
    async with (
        running_agent(config) as agent,
        grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch,
    ):
        stub = agent_stub(ch)
        info = await stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest())
        assert list(info.engines) == ["reference"]
        assert "cannot import vllm" in info.engine_notes[0]

        cases = [
            ("sglang", "", grpc.StatusCode.INVALID_ARGUMENT, "engine 'sglang' is not known"),
            ("vllm", "", grpc.StatusCode.FAILED_PRECONDITION, "cannot import vllm"),
            ("vllm", '{"max_model_len": "long"}', grpc.StatusCode.INVALID_ARGUMENT,
             "engine_args.max_model_len' must be int"),
            ("vllm", '{"block": 16}', grpc.StatusCode.INVALID_ARGUMENT,
             "unknown config key 'engine_args.block'"),
        ]  # fmt: skip
        for engine, args, code, said in cases:
            request = start_request("w-e", tiny_model)
            request.engine, request.engine_args_json = engine, args
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.StartWorker(request, timeout=30)
            assert refused.value.code() == code, refused.value.details()
            assert said in (refused.value.details() or ""), refused.value.details()
        assert not (await stub.GetAgentInfo(agent_pb2.GetAgentInfoRequest())).workers
        assert not list((state / "workers").glob("*.json"))

        # "reference" (and the empty default) still start the reference engine's worker.
        request = start_request("w-ref", tiny_model)
        request.engine = "reference"
        started = await stub.StartWorker(request, timeout=120)
        assert started.endpoint
