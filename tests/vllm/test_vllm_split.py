"""A split answer served by two vLLM workers: the prompt on the prefill worker, the rest on the
decode worker, the session's KV handed over through vLLM's own kv_transfer_params.

What a user sees: with only a prefill and a decode vLLM worker of a model, Route answers the
pair; the gateway (the real process, through its OpenAI API) runs the prompt on the prefill
worker until its first token, exports the session with its KV (the prefill worker's vLLM
stores it: a request whose kv_transfer_params name the export), imports it on the decode
worker (whose vLLM loads it: a request naming the same export) and streams one answer whose
tokens are exactly an unsplit run's. The decode worker made exactly the tokens after the
hand-over, its own log says how much KV vLLM loaded, and the store is empty afterwards.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path

import grpc
import openai
import pytest
from fleetshift_gateway.tokenizer import ModelTokenizer

from fleetshift.v1 import fleet_pb2 as fpb
from fleetshift.v1 import operations_pb2 as pb
from fleetshift.v1 import operations_pb2_grpc as pb_grpc
from fleetshift.v1 import placement_pb2 as ppb
from fleetshift.v1 import placement_pb2_grpc as ppb_grpc
from fleetshift.v1 import worker_pb2, worker_pb2_grpc
from fleetshift_daemon.localfleet import LocalFleet, ServedModel
from tests import fleet_checks
from tests.vllm.conftest import KV_MODEL, KV_STORE

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
TOKENS = 40
PROMPT = random.Random(9).choices(range(3, 500), k=200)  # over one vLLM block: KV travels


async def start(ops: pb_grpc.OperationsStub, node: str, role: int) -> fpb.WorkerStatus:
    request = pb.StartFleetWorkerRequest(model=KV_MODEL, role=role, node_name=node)
    status: fpb.WorkerStatus = await ops.StartWorker(request, timeout=600)
    return status


async def counters(endpoint: str) -> fpb.WorkerCounters:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        result: fpb.WorkerCounters = await worker_pb2_grpc.WorkerServiceStub(ch).GetCounters(
            worker_pb2.GetWorkerCountersRequest(), timeout=10
        )
    return result


async def unsplit(endpoint: str) -> list[int]:
    """The same request on one worker, nothing handed over (greedy: the reference)."""
    async with grpc.aio.insecure_channel(endpoint) as ch:
        stream = worker_pb2_grpc.WorkerServiceStub(ch).Generate(
            worker_pb2.GenerateRequest(
                prompt_tokens=PROMPT,
                max_new_tokens=TOKENS,
                sampling=worker_pb2.WorkerSampling(temperature=0.0),
                session_id="unsplit",
            )
        )
        return [m.token async for m in stream]


async def split_pool(fleet: LocalFleet) -> tuple[fpb.WorkerStatus, fpb.WorkerStatus]:
    async with grpc.aio.insecure_channel(fleet.daemon_address) as daemon:
        ops = pb_grpc.OperationsStub(daemon)
        prefill = await start(ops, "cpu-a", fpb.WORKER_ROLE_PREFILL)
        decode = await start(ops, "cpu-b", fpb.WORKER_ROLE_DECODE)
        deadline = time.monotonic() + 60  # Route knows a worker from its first heartbeat on
        want = {prefill.worker_id, decode.worker_id}
        while set(await fleet_checks.serving(daemon)) != want:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        look = ppb.RouteRequest(model=KV_MODEL, prompt_tokens=len(PROMPT), reroute=True)
        look.expected_output_tokens = TOKENS
        routed = await ppb_grpc.PlacementStub(daemon).Route(look, timeout=10)
    assert (routed.endpoint, routed.decode_endpoint) == (prefill.endpoint, decode.endpoint)
    return prefill, decode


def worker_log(fleet: LocalFleet, worker_id: str) -> str:
    (found,) = fleet.state_dir.glob(f"**/{worker_id}.log")
    return found.read_text(errors="replace")


def gateway_log(fleet: LocalFleet) -> str:
    return "".join(p.read_text(errors="replace") for p in fleet.state_dir.glob("**/gateway*.log"))


async def test_a_split_answer_hands_the_kv_over_through_vllm(
    fleet: LocalFleet, vllm_model: Path
) -> None:
    prefill, decode = await split_pool(fleet)
    reference = await unsplit(prefill.endpoint)
    await asyncio.sleep(1.5)  # vLLM's counters reach /metrics at its next stats interval
    before = {w.endpoint: await counters(w.endpoint) for w in (prefill, decode)}
    fleet.start_gateway([ServedModel(KV_MODEL, vllm_model)], timeout_s=120)
    client = openai.OpenAI(base_url=fleet.gateway_url, api_key="-", max_retries=0, timeout=300)

    streamed = await asyncio.to_thread(
        lambda: [
            c.choices[0].text
            for c in client.completions.create(
                model=KV_MODEL, prompt=PROMPT, max_tokens=TOKENS, stream=True, temperature=0
            )
        ]
    )
    tok = ModelTokenizer.load(KV_MODEL, vllm_model)
    assert "".join(streamed) == tok.decode(reference)

    # The decode worker's vLLM loaded the prefill worker's KV (its external prefix-cache
    # counter grew across the import): the KV went through vLLM's kv_transfer_params. The
    # note names the context at the hand-over: the prompt and the tokens the prefill worker
    # had made by the time the gateway's export held the session (one or more).
    log = worker_log(fleet, decode.worker_id).splitlines()
    imported = [ln for ln in log if " imported: " in ln]
    assert len(imported) == 1, (
        f"decode worker imported {len(imported)} sessions; gateway log:\n"
        + gateway_log(fleet)[-4000:]
        + "\nprefill worker log:\n"
        + worker_log(fleet, prefill.worker_id)[-4000:]
    )
    (note,) = imported
    found = re.search(
        r"KV restored by vLLM's FleetShiftDiskConnector: (\d+) of (\d+) context", note
    )
    assert found, note
    loaded, context = int(found.group(1)), int(found.group(2))
    handed = context - len(PROMPT)
    # The prefill worker held the session after its first token (hold_after_tokens): the
    # hand-over never races the engine, however fast it decodes.
    assert handed == 1 and loaded == (context - 1) // 128 * 128, note
    await asyncio.sleep(1.5)  # vLLM's counters reach /metrics at its next stats interval
    after = {w.endpoint: await counters(w.endpoint) for w in (prefill, decode)}
    decoded = {e: after[e].decode_tokens - before[e].decode_tokens for e in after}
    # The decode worker made exactly every token after the hand-over; the prefill worker
    # the ones before it (and the one-token request that stored the KV, maybe one cut off).
    assert decoded[decode.endpoint] == TOKENS - handed, (decoded, handed)
    assert handed + 1 <= decoded[prefill.endpoint] <= handed + 3, (decoded, handed)
    store = fleet.state_dir / KV_STORE
    assert not store.exists() or not any(store.iterdir())  # and its folder is gone
