"""Validation of what agents and operators send, before anything touches the registry.

Every rule names the field it checks, because the caller is usually a machine (an agent, the
fleet's router) whose log line is the only place a human will see what was wrong.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.estimator import Completion
from fleetshift_daemon.core.fleet import GpuInfo, Registration
from fleetshift_daemon.core.routing import RouteRequest

GiB = 1024**3
NODE_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")
COMPUTE_CAPABILITY = re.compile(r"^\d{1,2}\.\d{1,2}$")


@dataclass(frozen=True)
class RegistrationLimits:
    max_node_name: int = 63
    max_gpus: int = 64
    min_gpu_memory_bytes: int = 1 * GiB
    max_gpu_memory_bytes: int = 1024 * GiB
    max_text: int = 128
    max_workers_per_heartbeat: int = 256


def check_node_name(name: str, limits: RegistrationLimits, field: str = "node_name") -> None:
    if not name:
        raise InvalidArgument(f"{field} must not be empty", field=field)
    if len(name) > limits.max_node_name:
        raise InvalidArgument(
            f"{field} is {len(name)} characters long, the limit is {limits.max_node_name}",
            field=field,
        )
    if not NODE_NAME.match(name):
        raise InvalidArgument(
            f"{field} {name!r} may hold only letters, digits, '.', '_' and '-' and must start "
            "and end with a letter or digit",
            field=field,
        )


def check_address(address: str, field: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(f"{field} must be host:port, got {address!r}", field=field)


def check_registration(reg: Registration, limits: RegistrationLimits) -> None:
    check_node_name(reg.node_name, limits)
    check_address(reg.agent_address, "agent_address")
    if not reg.gpus:
        raise InvalidArgument("gpus must list at least one GPU", field="gpus")
    if len(reg.gpus) > limits.max_gpus:
        raise InvalidArgument(
            f"gpus lists {len(reg.gpus)} GPUs, the limit is {limits.max_gpus}", field="gpus"
        )
    indices = [g.index for g in reg.gpus]
    if len(set(indices)) != len(indices):
        raise InvalidArgument("gpus[].index values must be unique", field="gpus.index")
    for position, gpu in enumerate(reg.gpus):
        _check_gpu(gpu, f"gpus[{position}]", set(indices), limits)
    for name in ("driver", "cuda", "torch", "agent"):
        if len(getattr(reg.versions, name)) > limits.max_text:
            raise InvalidArgument(f"versions.{name} is too long", field=f"versions.{name}")


def _check_gpu(gpu: GpuInfo, where: str, indices: set[int], limits: RegistrationLimits) -> None:
    if not gpu.product_name.strip():
        raise InvalidArgument(
            f"{where}.product_name must not be empty", field=f"{where}.product_name"
        )
    if len(gpu.product_name) > limits.max_text:
        raise InvalidArgument(f"{where}.product_name is too long", field=f"{where}.product_name")
    if not limits.min_gpu_memory_bytes <= gpu.memory_bytes <= limits.max_gpu_memory_bytes:
        raise InvalidArgument(
            f"{where}.memory_bytes must be between {limits.min_gpu_memory_bytes} and "
            f"{limits.max_gpu_memory_bytes}, got {gpu.memory_bytes}",
            field=f"{where}.memory_bytes",
        )
    if gpu.compute_capability and not COMPUTE_CAPABILITY.match(gpu.compute_capability):
        raise InvalidArgument(
            f"{where}.compute_capability must look like '9.0', got {gpu.compute_capability!r}",
            field=f"{where}.compute_capability",
        )
    for peer in gpu.nvlink_peers:
        if peer == gpu.index or peer not in indices:
            raise InvalidArgument(
                f"{where}.nvlink_peers names GPU {peer}, which is not another GPU of this node",
                field=f"{where}.nvlink_peers",
            )


def check_route_lengths(request: RouteRequest, context_tokens: int) -> None:
    """A request's lengths must fit its model's context (the API's static bound is the
    longest context of any model; this one is the model's own). Refused, it changes nothing.

    A stated output is an expectation, not a limit, so only each length is refused here; the
    traffic window and the estimator clip prompt + output to the context
    (``traffic.bounded_observation``)."""
    for name, value in (
        ("prompt_tokens", request.prompt_tokens),
        ("expected_output_tokens", request.expected_output_tokens),
    ):
        if value is not None and value > context_tokens:
            raise InvalidArgument(
                f"{name} must be <= {context_tokens} (the context of model "
                f"{request.model!r}), got {value}",
                field=name,
            )


def check_finished(completions: Sequence[Completion], context_tokens: int, where: str) -> None:
    """Finished sessions a heartbeat reports for one worker (``where``:
    ``workers[i].finished_sessions``) must each name a session, have a prompt, and fit the
    model's context: a session longer than its context cannot have happened, and learning
    from it would poison the estimator. The API's table already refused what no context
    allows (negative lengths, beyond MAX_CONTEXT_TOKENS, more than MAX_FINISHED_SESSIONS
    entries); this is the model's own limit and the proto3 zeros the table cannot see."""
    for j, c in enumerate(completions):
        at = f"{where}[{j}]"
        if not c.session_id:
            raise InvalidArgument(f"{at}.session_id must not be empty", field=f"{at}.session_id")
        if c.prompt_tokens < 1:
            raise InvalidArgument(
                f"{at}.prompt_tokens must be >= 1, got {c.prompt_tokens}",
                field=f"{at}.prompt_tokens",
            )
        if c.output_tokens < 0:
            raise InvalidArgument(
                f"{at}.output_tokens must be >= 0, got {c.output_tokens}",
                field=f"{at}.output_tokens",
            )
        if c.prompt_tokens + c.output_tokens > context_tokens:
            field = "prompt_tokens" if c.prompt_tokens > context_tokens else "output_tokens"
            raise InvalidArgument(
                f"{at}.{field}: prompt_tokens + output_tokens must be <= {context_tokens} (the "
                f"model's context), got {c.prompt_tokens} + {c.output_tokens}",
                field=f"{at}.{field}",
            )
