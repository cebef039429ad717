"""The vLLM server process beside the shim: its command line, its start and its end.

vLLM runs as its own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``)
in whatever interpreter has vLLM (the agent's ``vllm_python``), so vLLM's pins (its torch,
its transformers) never meet FleetShift's. The shim starts it on a free loopback port, copies
its output into the worker's log while keeping the last lines, and reports a server that
exits before it serves with the cause vLLM gave (its last error line), so a bad engine
argument or a vLLM that cannot start reads as one sentence in the agent's StartWorker error.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from fleetshift_common.config import EngineArgs

DISK_CONNECTOR = "FleetShiftDiskConnector"
# vLLM's NIXL connector: the destination's vLLM pulls a session's KV blocks straight from the
# source vLLM's memory (UCX; host buffers on a CPU node), found through the source's side
# channel (a ZMQ port of its own, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT): no shared store.
NIXL_CONNECTOR = "NixlConnector"
DISK_CONNECTOR_MODULE = "fleetshift_vllm_disk"
# vLLM's ExampleConnector, changed in two ways. (1) Its lookup and its load use the same
# tokens: upstream looks a prompt of L tokens up by its first (L-2)//B*B tokens but loads
# (L-1)//B*B of them, so a prompt of 1 + k*B tokens whose one-block-shorter prefix was
# stored makes the engine load a file that does not exist, and the engine core dies; moves
# start requests of any length, so both sides here use (L-1)//B*B. (2) It stores and loads
# only for a request that names an export in vLLM's kv_transfer_params
# ({"fleetshift_kv": "store" | "load", "fleetshift_kv_id": <32 hex>}), in a folder named by
# that id and the tokens (kv_store.FOLDER): upstream stores every request's prompt (the
# store grows with all traffic) and lets any request with the same prefix load it, so no
# folder could ever be deleted safely. Here each folder is single-use: written by one export,
# read by the one import that names it, then deleted (kv_store). The id rides through vLLM's
# metadata as a "multimodal hash", which upstream already threads from the scheduler to the
# workers and into the folder's key. (3) A load may name how many tokens the export holds
# ("fleetshift_kv_tokens", whole blocks): a pre-copied export holds the context as it stood
# while the session still decoded, and the request that continues the session after its
# final delta is longer; it loads the export's blocks and computes the rest. Without it the
# load covers the request's whole blocks, as before. It runs inside vLLM's interpreter (no
# FleetShift there): the shim writes it beside the server and puts it on the server's
# PYTHONPATH. (4) It copies whole blocks (BLOCK_COPY_SOURCE, one copy per block) where
# upstream gathers and scatters token by token, and names an export's folder once per
# request, not once per layer: py-spy on an 8k-token export found the per-token gather most
# of its time, inside the engine step that the sessions still decoding on the source wait
# for (a pre-copy's hiccup).
BLOCK_COPY_SOURCE = """
def _whole_blocks(slot_mapping, block_size):
    # The blocks a slot mapping covers when it covers whole blocks, each slot in order (as
    # make_meta builds one for a store or a load); None otherwise.
    n = int(slot_mapping.numel())
    if n == 0 or n % block_size:
        return None
    starts = slot_mapping[::block_size]
    if bool((starts % block_size).any()):
        return None
    offsets = torch.arange(block_size, device=starts.device, dtype=starts.dtype)
    if not torch.equal((starts.view(-1, 1) + offsets).flatten(), slot_mapping):
        return None
    return starts // block_size


def take_tokens(layer, slot_mapping, block_size):
    # A [B, H, N, C] paged layer's tokens at slot_mapping, as [T, H, C] (upstream's
    # layer[slot // N, :, slot % N]), copied a whole block at a time where it can be.
    blocks = _whole_blocks(slot_mapping, block_size)
    if blocks is None or layer.dim() < 4:
        return layer[slot_mapping // block_size, :, slot_mapping % block_size]
    picked = layer.index_select(0, blocks).transpose(1, 2)
    return picked.reshape(-1, layer.shape[1], *layer.shape[3:])


def put_tokens(layer, slot_mapping, block_size, kv):
    # The inverse: write [T, H, C] into the layer's slots, a whole block at a time.
    blocks = _whole_blocks(slot_mapping, block_size)
    if blocks is None or layer.dim() < 4:
        layer[slot_mapping // block_size, :, slot_mapping % block_size] = kv
        return
    shaped = kv.reshape(blocks.numel(), block_size, layer.shape[1], *layer.shape[3:])
    layer.index_copy_(0, blocks, shaped.transpose(1, 2).to(layer.dtype))
"""
DISK_CONNECTOR_SOURCE = (
    """
import hashlib
import os

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    MLACommonMetadata,
    align_to_block_size,
)
from vllm.utils.gpu_sync_debug import gpu_sync_allowed

MARK = "fleetshift-kv:"
"""
    + BLOCK_COPY_SOURCE
    + """


def _asked(request):
    params = getattr(request, "kv_transfer_params", None) or {}
    export_id = str(params.get("fleetshift_kv_id", ""))
    what = str(params.get("fleetshift_kv", ""))
    if len(export_id) != 32 or any(c not in "0123456789abcdef" for c in export_id):
        return "", ""
    return what, export_id


def _load_len(request, block_size):
    # The prompt tokens a load covers: the export's own count when it names one (whole
    # blocks, never past the prompt's), else the prompt's whole blocks.
    tokens = len(request.prompt_token_ids or [])
    n = align_to_block_size(tokens, block_size)
    named = (getattr(request, "kv_transfer_params", None) or {}).get("fleetshift_kv_tokens")
    if isinstance(named, int) and 0 < named < n and named % block_size == 0:
        return named
    return n


class FleetShiftDiskConnector(ExampleConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._fs_store = {}  # request id -> export id: store its prompt's KV
        self._fs_load = {}  # request id -> export id: load its prompt's KV
        self._fs_folders_of = None  # the step's metadata the folders below belong to
        self._fs_folders = {}  # id(ReqMeta) -> its folder, named once per step, not per layer

    def _folder_of(self, request, create):
        meta = self._get_connector_metadata()
        if self._fs_folders_of is not meta:
            self._fs_folders_of, self._fs_folders = meta, {}
        folder = self._fs_folders.get(id(request))
        if folder is None:
            folder = self._generate_foldername_debug(
                request.token_ids, request.mm_hashes, create_folder=create
            )
            self._fs_folders[id(request)] = folder
        return folder

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if isinstance(attn_metadata, MLACommonMetadata):
            return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        for request in self._get_connector_metadata().requests:
            if not request.is_store:
                continue
            folder = self._folder_of(request, create=True)
            with gpu_sync_allowed():
                slots = request.slot_mapping.to(kv_layer.device)
                kv = take_tokens(kv_layer, slots, self._block_size).detach().cpu()
            path = os.path.join(folder, layer_name + ".safetensors")
            safetensors.torch.save_file({"kv_cache": kv.contiguous()}, path)

    def start_load_kv(self, forward_context, **kwargs):
        attn = forward_context.attn_metadata
        if not isinstance(attn, dict) or any(
            isinstance(m, MLACommonMetadata) for m in attn.values()
        ):
            return super().start_load_kv(forward_context, **kwargs)
        for request in self._get_connector_metadata().requests:
            if request.is_store:
                continue
            folder = self._folder_of(request, create=False)
            for layer_name, layer in forward_context.no_compile_layers.items():
                paged = getattr(layer, "kv_cache", None)
                if paged is None:
                    continue
                path = os.path.join(folder, layer_name + ".safetensors")
                with gpu_sync_allowed():
                    kv = safetensors.torch.load_file(path)["kv_cache"].to(paged.device)
                    slots = request.slot_mapping.to(paged.device)
                put_tokens(paged, slots, self._block_size, kv)

    def _generate_foldername_debug(self, token_ids, mm_hashes, create_folder=False):
        marks = [h for h in mm_hashes or [] if h.startswith(MARK)]
        if not marks:
            return super()._generate_foldername_debug(token_ids, mm_hashes, create_folder)
        ids = ",".join(str(int(t)) for t in token_ids.tolist())
        digest = hashlib.sha256(ids.encode()).hexdigest()[:32]
        folder = os.path.join(self._storage_path, "fs-" + marks[0][len(MARK):] + "-" + digest)
        if create_folder:
            os.makedirs(folder, exist_ok=True)
        return folder

    def _found_match_for_prompt(self, prompt_token_ids, mm_hashes):
        n = align_to_block_size(len(prompt_token_ids), self._block_size)
        folder = self._generate_foldername_debug(
            torch.tensor(prompt_token_ids)[:n], mm_hashes, create_folder=False
        )
        return n > 0 and os.path.exists(folder)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        what, export_id = _asked(request)
        n = _load_len(request, self._block_size)
        tokens = list(request.prompt_token_ids or [])[: n + 1]  # aligns down to n
        if what != "load" or not self._found_match_for_prompt(tokens, [MARK + export_id]):
            return 0, False
        return max(0, n - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        what, export_id = _asked(request)
        if what == "store":
            self._fs_store[request.request_id] = export_id
        if what == "load" and num_external_tokens > 0:
            self._fs_load[request.request_id] = export_id
            self._requests_need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output):
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            rid = new_req.req_id
            store = rid not in self._requests_need_load and rid in self._fs_store
            export_id = self._fs_store.pop(rid, "") if store else self._fs_load.get(rid, "")
            token_ids = new_req.prompt_token_ids or []
            if rid in self._requests_need_load:
                n = _load_len(self._requests_need_load[rid], self._block_size)
                token_ids = token_ids[: n + 1]  # the export's blocks (make_meta aligns down)
            if store or rid in self._requests_need_load:
                meta.add_request(
                    token_ids=token_ids,
                    block_ids=new_req.block_ids[0],
                    block_size=self._block_size,
                    is_store=store,
                    mm_hashes=[MARK + export_id],
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):  # resumed after a preemption: load again
            if rid not in self._requests_need_load or rid not in cached.resumed_req_ids:
                continue
            request = self._requests_need_load[rid]
            total = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[rid]
            total = min(total, _load_len(request, self._block_size) + 1)
            meta.add_request(
                token_ids=request.all_token_ids[:total],
                block_ids=cached.new_block_ids[i][0],
                block_size=self._block_size,
                is_store=False,
                mm_hashes=[MARK + self._fs_load.get(rid, "")],
            )
        self._requests_need_load.clear()
        return meta

    def request_finished(self, request, block_ids):
        self._fs_store.pop(request.request_id, None)
        self._fs_load.pop(request.request_id, None)
        return super().request_finished(request, block_ids)
"""
)
_ERROR_LINE = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception)\b.*|.*\berror: .*)")
PR_SET_PDEATHSIG = 1


class VllmStartFailed(RuntimeError):
    """The vLLM server ended, or never answered, before it served."""


@dataclass(frozen=True)
class ServerSpec:
    python: str  # an interpreter that imports vllm
    model_dir: str
    served_name: str
    engine_args: EngineArgs
    tp: int = 1
    threads: int = 0  # CPU threads for vLLM's OpenMP; 0: vLLM's own choice
    cuda: bool = False  # on a GPU node (else vLLM's CPU build: KV size by env)
    plugin_dir: str = ""  # where the shim wrote FleetShift's connector for vLLM to import
    # NIXL's side channel: where other workers' vLLM ask this one for a session's KV blocks
    # (the worker's own address, so a destination on another host reaches it)
    nixl_host: str = "127.0.0.1"
    nixl_port: int = 0


def server_command(spec: ServerSpec, port: int) -> list[str]:
    """The vLLM server's argv for these engine arguments."""
    a = spec.engine_args
    argv = [
        spec.python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model_dir,
        "--served-model-name", spec.served_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", a.dtype,
        "--tensor-parallel-size", str(spec.tp),
        "--generation-config", "vllm",  # sampling defaults are FleetShift's, not the model dir's
    ]  # fmt: skip
    if a.max_model_len:
        argv += ["--max-model-len", str(a.max_model_len)]
    if a.enforce_eager:
        argv.append("--enforce-eager")
    if spec.cuda and a.gpu_memory_utilization:
        argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if a.kv_connector:
        argv += ["--kv-transfer-config", kv_transfer_config(a, spec.cuda)]
    return argv + list(a.extra_args)


def kv_transfer_config(a: EngineArgs, cuda: bool = False) -> str:
    """vLLM's --kv-transfer-config: the connector, its role, a disk connector's path, and
    NIXL's staging buffers in host memory where there is no GPU."""
    config: dict[str, object] = {"kv_connector": a.kv_connector, "kv_role": a.kv_role}
    if a.kv_connector_path:
        config["kv_connector_extra_config"] = {"shared_storage_path": a.kv_connector_path}
    if a.kv_connector == DISK_CONNECTOR:
        config["kv_connector_module_path"] = DISK_CONNECTOR_MODULE
    if a.kv_connector == NIXL_CONNECTOR:
        config["kv_buffer_device"] = "cuda" if cuda else "cpu"
        # A pull that fails (the source gone, its lease expired) recomputes the blocks: the
        # session goes on from its token history rather than ending with an error (vLLM's
        # default, "fail"). The source keeps an export's blocks for the same TTL the disk
        # store keeps an export's folder: a move imports each session seconds after its
        # export, but the first pull from a new source waits for NIXL's handshake, which
        # outlived vLLM's own 30 s lease on this loaded 2-core machine.
        config["kv_load_failure_policy"] = "recompute"
        config["kv_connector_extra_config"] = {"kv_lease_duration": int(a.kv_store_ttl_s)}
    return json.dumps(config)


def server_env(spec: ServerSpec, base: Mapping[str, str]) -> dict[str, str]:
    env = {
        **base,
        "HF_HUB_OFFLINE": "1",  # a model directory, never a hub
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /is_paused
        "PYTHONUNBUFFERED": "1",
    }
    if not spec.cuda:
        # vLLM's CPU build sizes its KV cache from this (whole GiB).
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(spec.engine_args.kv_cache_gib)))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if spec.threads:
            env["OMP_NUM_THREADS"] = str(spec.threads)
    if spec.engine_args.kv_connector == NIXL_CONNECTOR and spec.nixl_port:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.nixl_host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.nixl_port)
        if not spec.cuda:  # host memory only: shared memory on one host, TCP across hosts
            env.setdefault("UCX_TLS", "tcp,sm,self")
    if spec.plugin_dir:
        paths = (spec.plugin_dir, base.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def write_plugins(folder: str) -> None:
    """Write FleetShift's connector module where vLLM's interpreter will import it."""
    with open(os.path.join(folder, DISK_CONNECTOR_MODULE + ".py"), "w", encoding="utf-8") as out:
        out.write(DISK_CONNECTOR_SOURCE)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """The server ends when the shim dies, even by SIGKILL (Linux's parent-death signal)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class VllmServer:
    """One vLLM server process; its output goes to ``sys.stdout`` (the worker's log)."""

    def __init__(self, spec: ServerSpec, port: int | None = None) -> None:
        self.spec = spec
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tail: collections.deque[str] = collections.deque(maxlen=80)
        self._proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else 0

    def start(self) -> None:
        self._proc = subprocess.Popen(
            server_command(self.spec, self.port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=server_env(self.spec, os.environ),
            preexec_fn=_die_with_parent,
        )
        self._pump = threading.Thread(target=self._copy_output, name="vllm-log", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in self._proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            self._tail.append(line)
            sys.stdout.write(f"[vllm] {line}\n")
            sys.stdout.flush()

    def exited(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def cause(self) -> str:
        """vLLM's last error line (an exception or argparse's complaint), else its last line."""
        if self._pump is not None:
            self._pump.join(timeout=5)  # the pipe closes when the server (and its children) end
        lines = [line.rstrip() for line in self._tail if line.strip()]
        for i in range(len(lines) - 1, -1, -1):
            found = _ERROR_LINE.search(lines[i])
            if found:  # with the indented detail lines some errors carry (pydantic's do)
                detail = [x.strip() for x in lines[i + 1 :] if x.startswith(" ") and "://" not in x]
                return " ".join([found.group(1), *detail[:2]])
        return lines[-1].strip() if lines else "(no output)"

    def failed(self, why: str) -> VllmStartFailed:
        return VllmStartFailed(f"vLLM server {why}: {self.cause()}")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (vLLM shuts its engine core down), SIGKILL after the grace."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
