"""The vLLM tier: real vLLM servers (its CPU build, in .venv-vllm) behind FleetShift's vLLM
worker, started by real agents on the daemon's command.

Without .venv-vllm the tier is skipped, naming the script that makes it; under CI=true its
absence fails every test instead (CI builds it: scripts/test sources scripts/vllm-env.sh).
Each vLLM server takes about 3 GB and 20-30 s to start on this machine, so a test runs at most
two at once and the fleets here are small.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetshift.v1 import worker_pb2
from fleetshift_agent.engine.make_model import main as make_model
from fleetshift_daemon.localfleet import LocalFleet, NodeSpec
from tests.ci import in_ci
from tests.conftest import REPO

MODEL = "tiny-vllm"
KV_MODEL = "tiny-vllm-kv"  # the same, with FleetShift's disk KV connector (moves carry KV)
KV_STORE = "kv-store"  # its connector's directory, under the fleet's root
NIXL_MODEL = "tiny-vllm-nixl"  # the same, with vLLM's NIXL connector (KV pulled over UCX)
BAD_MODEL = "tiny-vllm-bad"  # engine arguments vLLM refuses
MAX_MODEL_LEN = 512
NODES = (
    # Both of one GPU model: a move between them would be a warm one for the reference engine.
    NodeSpec("cpu-a", "NVIDIA H100 80GB HBM3", 1),
    NodeSpec("cpu-b", "NVIDIA H100 80GB HBM3", 1),
)
# Greedy sessions: (id, prompt). Their tokens must equal vLLM's alone, and survive moves.
SESSIONS = [
    ("g-1", [11, 22, 33, 44, 55]),
    ("g-2", [5, 6, 7, 8, 9, 10, 11, 12]),
    ("g-3", [300, 301, 302]),
    ("g-4", [42] * 20),
]
# The same arguments vLLM alone gets in vllm_alone(): the model's defaults but for these.
# float32 (vLLM's CPU build would take the model's float32 down to bfloat16): a session that
# moves recomputes its context in one prefill, and in float32 that matches the uninterrupted
# run's step-by-step KV closely enough that greedy choices do not flip.
ENGINE_ARGS = (
    f'dtype = "float32"\nmax_model_len = {MAX_MODEL_LEN}\nkv_cache_gib = 1\nenforce_eager = true\n'
)


def vllm_python_or_skip() -> str:
    path = os.environ.get("FLEETSHIFT_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if Path(path).is_file():
        return path
    if in_ci():
        pytest.fail(
            f"vLLM's CPU build is missing ({path}) and CI=true: scripts/vllm-env.sh makes it"
        )
    pytest.skip(f"no vLLM interpreter at {path}: scripts/test-vllm makes .venv-vllm")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama-style model and tokenizer made here (no hub), loadable by both engines."""
    out = tmp_path_factory.mktemp("tiny-vllm") / MODEL
    assert make_model(["--out", str(out), "--preset", "tiny-vllm", "--seed", "5"]) == 0
    return out


def request(
    sid: str, prompt: list[int], tokens: int, suffix: str = "", hold: int = 0
) -> worker_pb2.GenerateRequest:
    """``hold``: the session stops after that many tokens and waits (``hold_after_tokens``),
    so a test that pauses it there finds it mid-stream however fast vLLM decodes."""
    return worker_pb2.GenerateRequest(
        prompt_tokens=prompt,
        max_new_tokens=tokens,
        sampling=worker_pb2.WorkerSampling(temperature=0.0),
        session_id=sid + suffix,
        hold_after_tokens=hold,
    )


_ALONE = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    model, max_len, tokens, prompts = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=model, max_model_len=max_len, enforce_eager=True, generation_config="vllm",
              dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_alone(python: str, model: Path, tokens: int, tmp: Path) -> dict[str, list[int]]:
    """The sessions' greedy tokens from vLLM alone (its offline engine, no FleetShift)."""
    script = tmp / "alone.py"
    script.write_text(_ALONE)
    prompts = json.dumps([p for _, p in SESSIONS])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        [python, str(script), str(model), str(MAX_MODEL_LEN), str(tokens), prompts],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"vLLM alone failed ({done.returncode}): {done.stderr[-3000:]}"
    return {sid: toks for (sid, _), toks in zip(SESSIONS, json.loads(lines[-1][7:]), strict=True)}


_ALONE_RUNS = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
if __name__ == "__main__":
    model, max_len, runs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    llm = LLM(model=model, max_model_len=max_len, enforce_eager=True, generation_config="vllm",
              dtype="float32")
    params = [SamplingParams(temperature=r["temperature"], seed=r["seed"],
                             max_tokens=r["max_tokens"], ignore_eos=True) for r in runs]
    outs = llm.generate([TokensPrompt(prompt_token_ids=r["prompt"]) for r in runs], params)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def vllm_alone_runs(
    python: str, model: Path, runs: list[dict[str, object]], tmp: Path
) -> list[list[int]]:
    """Each run's tokens from vLLM alone (its offline engine, no FleetShift); a run is
    {prompt, max_tokens, temperature, seed} and is sampled with its own seeded generator."""
    script = tmp / "alone_runs.py"
    script.write_text(_ALONE_RUNS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        [python, str(script), str(model), str(MAX_MODEL_LEN), json.dumps(runs)],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"vLLM alone failed ({done.returncode}): {done.stderr[-3000:]}"
    result: list[list[int]] = json.loads(lines[-1][7:])
    return result


def make_fleet(
    root: Path,
    model: Path,
    vllm_python: str,
    nodes: tuple[NodeSpec, ...],
    env: dict[str, str] | None = None,
    tls: bool = False,
) -> LocalFleet:
    models = "".join(
        f'[[models]]\nname = "{name}"\nhf_config = "{model}"\nmodel_dir = "{model}"\n'
        f'tp_options = [1]\nengine = "vllm"\n[models.engine_args]\n{args}'
        for name, args in (
            (MODEL, ENGINE_ARGS),
            (
                KV_MODEL,
                ENGINE_ARGS + 'kv_connector = "FleetShiftDiskConnector"\n'
                f'kv_connector_path = "{root / KV_STORE}"\n',
            ),
            (NIXL_MODEL, ENGINE_ARGS + 'kv_connector = "NixlConnector"\n'),
            # Longer than the model's 1024 positions: vLLM refuses it when the worker starts.
            (BAD_MODEL, "max_model_len = 4096\nkv_cache_gib = 1\n"),
        )
    )
    return LocalFleet(
        root,
        nodes,
        heartbeat_interval_s=0.5,
        node_lost_after_s=10.0,
        daemon_extra="[planner]\ninterval_s = 0\n" + models,
        agent_extra=(
            f'worker_threads = 1\nworker_start_timeout_s = 580\nvllm_python = "{vllm_python}"\n'
        ),
        env=dict(env or {}),
        tls=tls,
    )


@pytest.fixture
def fleet(tmp_path: Path, vllm_model: Path, vllm_python: str) -> Iterator[LocalFleet]:
    local = make_fleet(tmp_path / "fleet", vllm_model, vllm_python, NODES)
    try:
        local.start(timeout_s=120)
        yield local
    finally:
        local.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each test's call report on its item: the crash tests' shared fleet is discarded
    after a case that failed, so the next one starts clean."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]
