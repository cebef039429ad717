"""``fleetshift``: the operator's command line.

It speaks only the public gRPC API, exactly like grpcurl would, so anything it shows an
operator can also be scripted against the daemon directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from rich.console import Console
from rich.table import Table

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift.v1 import operations_pb2, placement_pb2
from fleetshift.v1 import operations_pb2_grpc as operations_grpc
from fleetshift.v1 import placement_pb2_grpc as placement_grpc
from fleetshift_common.helpformat import DefaultsHelpFormatter
from fleetshift_daemon.cli import calibrate
from fleetshift_daemon.cli.progress import operation_summary, operations_table, watch_operation
from fleetshift_daemon.cli.tables import (
    DROP_FIRST,
    fit,
    nodes_table,
    plan_table,
    traffic_table,
    workers_table,
)
from fleetshift_daemon.localfleet import (
    LocalFleet,
    ServedModel,
    explore_commands,
    make_model,
    parse_model_option,
    signals_held,
    stop_on_signals,
)
from fleetshift_rpc import pki
from fleetshift_rpc.replicas import leader_hint, sync_daemon_channel
from fleetshift_rpc.security import client_credentials

# Piped output (CI logs, the README demo) is not a terminal: keep tables wide enough to read.
console = Console(width=None if sys.stdout.isatty() else 140)


def show(table: Table, kind: str) -> None:
    """Print a table that stays readable at the terminal's width (tables.fit)."""
    console.print(fit(table, console.width, DROP_FIRST.get(kind, ())))


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext to a loopback development daemon; TLS (+ certificate or token) otherwise.
    ``--daemon`` may list every replica: the channel fails over between them."""
    if not args.ca:
        return sync_daemon_channel(args.daemon)
    creds = client_credentials(args.ca, args.cert, args.key, args.token)
    return sync_daemon_channel(args.daemon, credentials=creds, tls_name=args.tls_name)


def _operator(args: argparse.Namespace) -> tuple[grpc.Channel, pb_grpc.FleetOperatorStub]:
    ch = open_channel(args)
    return ch, pb_grpc.FleetOperatorStub(ch)


def cmd_nodes(args: argparse.Namespace) -> int:
    ch, stub = _operator(args)
    with ch:
        reply = stub.ListNodes(pb.ListNodesRequest(), timeout=args.timeout)
    show(nodes_table(reply.nodes), "nodes")
    return 0


def cmd_cordon(args: argparse.Namespace) -> int:
    ch, stub = _operator(args)
    with ch:
        if args.command == "cordon":
            node = stub.CordonNode(
                pb.CordonNodeRequest(node_name=args.node, reason=args.reason), timeout=args.timeout
            )
        else:
            node = stub.UncordonNode(
                pb.UncordonNodeRequest(node_name=args.node), timeout=args.timeout
            )
    show(nodes_table([node]), "nodes")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        reply = placement_grpc.PlanningStub(ch).ListWorkers(
            placement_pb2.ListWorkersRequest(node_name=args.node, model=args.model),
            timeout=args.timeout,
        )
    show(workers_table(reply.workers), "workers")
    return 0


def cmd_traffic(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        mix = placement_grpc.PlanningStub(ch).GetTrafficMix(
            placement_pb2.GetTrafficMixRequest(model=args.model), timeout=args.timeout
        )
    show(traffic_table(mix), "traffic")
    return 0


def cmd_efficiency(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        report = placement_grpc.PlanningStub(ch).GetEfficiency(
            placement_pb2.GetEfficiencyRequest(history=args.history), timeout=args.timeout
        )
    if not report.HasField("latest"):
        console.print(report.note or "no efficiency sample yet (the planner job has not run)")
        return 0
    latest = report.latest
    colour = "green" if latest.efficiency >= report.threshold else "red"
    console.print(
        f"placement efficiency [{colour}]{latest.efficiency:.3f}[/] (threshold "
        f"{report.threshold:.2f}; below it for {report.below_threshold_for_s:.0f} s); goodput "
        f"{latest.current_goodput_tokens_per_s:,.0f} of {latest.best_goodput_tokens_per_s:,.0f} "
        "tokens/s possible"
    )
    console.print("history: " + " ".join(f"{s.efficiency:.2f}" for s in report.history))
    if report.measured_slo_reported:  # issue 11: what the workers measured, beside the model
        ok = report.measured_slo_attainment >= report.slo_attainment_target
        console.print(
            f"measured SLO attainment [{'green' if ok else 'red'}]"
            f"{report.measured_slo_attainment:.1%}[/] (target {report.slo_attainment_target:.1%}; "
            f"the model predicts {report.predicted_slo_attainment:.1%})"
        )
    console.print("predictions:\n" + calibrate.bases_text(report.predictions))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        plan = placement_grpc.PlanningStub(ch).PlanRebalance(
            placement_pb2.PlanRebalanceRequest(), timeout=max(args.timeout, 30)
        )
    show(plan_table(plan), "plan")
    console.print("pays off over the horizon" if plan.pays_off else "does not pay off yet")
    verdict = "would propose it now" if plan.would_propose else "would hold it"
    console.print(f"the periodic pass {verdict}: {plan.decision_reason}")
    console.print("predictions:\n" + calibrate.bases_text(plan.predictions))
    return 0


def _operation_done(
    args: argparse.Namespace, ch: grpc.Channel, op: operations_pb2.Operation
) -> int:
    if args.watch:
        op = watch_operation(ch, op)
    show(operation_summary(op), "operation")
    return 0 if op.state != operations_pb2.OPERATION_STATE_FAILED else 1


def cmd_rebalance(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        op = operations_grpc.OperationsStub(ch).Rebalance(
            operations_pb2.RebalanceRequest(idempotency_key=args.key, reason=args.reason),
            timeout=max(args.timeout, 30),
        )
        return _operation_done(args, ch, op)


def cmd_drain(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        op = operations_grpc.OperationsStub(ch).Drain(
            operations_pb2.DrainRequest(
                node_name=args.node, idempotency_key=args.key, reason=args.reason
            ),
            timeout=args.timeout,
        )
        return _operation_done(args, ch, op)


def cmd_move(args: argparse.Namespace) -> int:
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else []
    role = {"": 0, "prefill": 1, "decode": 2, "mixed": 3}[args.role]
    with open_channel(args) as ch:
        op = operations_grpc.OperationsStub(ch).MoveWorker(
            operations_pb2.MoveWorkerRequest(
                worker_id=args.worker,
                target_node=args.to,
                target_gpus=gpus,
                target_role=role,  # type: ignore[arg-type]
                idempotency_key=args.key,
                reason=args.reason,
            ),
            timeout=args.timeout,
        )
        return _operation_done(args, ch, op)


def cmd_operations(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        stub = operations_grpc.OperationsStub(ch)
        if args.id:
            op = stub.GetOperation(
                operations_pb2.GetOperationRequest(operation_id=args.id), timeout=args.timeout
            )
            return _operation_done(args, ch, op)
        reply = stub.ListOperations(
            operations_pb2.ListOperationsRequest(limit=args.limit), timeout=args.timeout
        )
    show(operations_table(reply.operations), "operations")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with open_channel(args) as ch:
        op = operations_grpc.OperationsStub(ch).CancelOperation(
            operations_pb2.CancelOperationRequest(operation_id=args.id), timeout=args.timeout
        )
    show(operation_summary(op), "operation")
    return 0


def _local_models(args: argparse.Namespace, state_dir: Path) -> list[ServedModel]:
    models = []
    for spec in args.model:
        name, folder = parse_model_option(spec)
        models.append(ServedModel(name, folder))
    for preset in args.preset:
        console.print(f"making the seeded {preset!r} reference model ...")
        models.append(ServedModel(preset, make_model(state_dir / f"model-{preset}", preset)))
    return models


def cmd_local_fleet(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="fleetshift-fleet-")).resolve()
    try:
        models = _local_models(args, state_dir)
    except ValueError as err:
        console.print(f"[red]local-fleet[/]: {err}")
        return 2
    if args.gateway and not models:
        console.print("[red]local-fleet[/]: --gateway needs a model (--preset or --model)")
        return 2
    fleet = LocalFleet(
        state_dir,
        daemon_extra="".join(m.toml() for m in models),
        agent_extra="worker_compile = false\n",
    )
    timeout = max(args.timeout, 120.0)
    with stop_on_signals():
        try:
            console.print(f"starting a local fleet under {fleet.state_dir} (logs in logs/) ...")
            fleet.start(timeout_s=timeout)
            console.print(f"daemon listening on {fleet.daemon_address}")
            for model in models:
                for _ in range(args.workers):
                    w = fleet.start_worker(model.name, pb.WORKER_ROLE_MIXED)
                    console.print(f"worker {w.worker_id} of {model.name} on {w.node_name or '?'}")
            if args.gateway:
                fleet.start_gateway(models)
                console.print(f"gateway (OpenAI API) on {fleet.gateway_url}")
            show(nodes_table(fleet.list_nodes()), "nodes")
            if args.keep:
                console.print(
                    f"running; Ctrl-C, or kill {os.getpid()}, stops everything it started. "
                    "From this directory, in another shell:"
                )
                for cmd in explore_commands(fleet, models[0].name if models else ""):
                    console.print(f"  {cmd}", markup=False, highlight=False, soft_wrap=True)
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            pass
        finally:
            with signals_held():
                fleet.stop()
    return 0


HELP_FORMAT = DefaultsHelpFormatter
DESCRIPTION = (
    "fleetshift: the operator's command line. It speaks only the daemon's public gRPC API, as "
    "grpcurl would, so anything it shows can also be scripted against the daemon directly."
)
DEFAULT_DAEMON = "127.0.0.1:50051"


class _HelpParser(argparse.ArgumentParser):
    """Every subcommand's parser shows its defaults, like the top one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HELP_FORMAT)
        super().__init__(*args, **kwargs)


class _Given(argparse.Action):
    """Stores the value and notes that the user chose it (for the unreachable-daemon hint)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.daemon_given = True


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetshift", description=DESCRIPTION, formatter_class=HELP_FORMAT
    )
    env = os.environ.get
    parser.add_argument(
        "--daemon",
        default=env("FLEETSHIFT_DAEMON", DEFAULT_DAEMON),
        action=_Given,
        help="the daemon's HOST:PORT, or every replica's, comma-separated (env FLEETSHIFT_DAEMON)",
    )
    parser.set_defaults(daemon_given="FLEETSHIFT_DAEMON" in os.environ)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    parser.add_argument(
        "--ca", default=env("FLEETSHIFT_CA", ""), help="fleet CA (env FLEETSHIFT_CA)"
    )
    parser.add_argument(
        "--cert",
        default=env("FLEETSHIFT_CERT", ""),
        help="operator certificate (env FLEETSHIFT_CERT)",
    )
    parser.add_argument(
        "--key", default=env("FLEETSHIFT_KEY", ""), help="its private key (env FLEETSHIFT_KEY)"
    )
    parser.add_argument(
        "--token", default=env("FLEETSHIFT_TOKEN", ""), help="bearer token (env FLEETSHIFT_TOKEN)"
    )
    parser.add_argument(
        "--tls-name",
        default=env("FLEETSHIFT_TLS_NAME", ""),
        help="the name every replica's certificate carries; default: the first replica's host "
        "(env FLEETSHIFT_TLS_NAME)",
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=_HelpParser,
    )
    sub.add_parser("nodes", help="list the fleet's nodes").set_defaults(run=cmd_nodes)
    sub.add_parser("demo", help="the whole loop on this machine: fleetshift demo --help")
    sub.add_parser("certs", help="issue a CA and certificates: fleetshift certs --help")
    sub.add_parser("gateway", help="serve the OpenAI API: fleetshift gateway --help")
    sub.add_parser(
        "simulate", help="replay a trace on a simulated fleet: fleetshift simulate --help"
    )
    sub.add_parser("calibration", help="fit the performance model on profiles, check another")
    sub.add_parser("profile", help="measure a model on a running worker: fleetshift profile --help")
    cordon = sub.add_parser("cordon", help="stop placing work on a node")
    cordon.add_argument("node", help="the node's name")
    cordon.add_argument("--reason", default="", help="recorded with the cordon")
    cordon.set_defaults(run=cmd_cordon)
    uncordon = sub.add_parser("uncordon", help="allow work on a node again")
    uncordon.add_argument("node", help="the node's name")
    uncordon.set_defaults(run=cmd_cordon)
    workers = sub.add_parser("workers", help="list workers")
    workers.add_argument("--node", default="", help="only this node's (empty: all)")
    workers.add_argument("--model", default="", help="only this model's (empty: all)")
    workers.set_defaults(run=cmd_workers)
    traffic = sub.add_parser("traffic", help="the live traffic mix per model")
    traffic.add_argument("--model", default="", help="only this model (empty: all)")
    traffic.set_defaults(run=cmd_traffic)
    eff = sub.add_parser("efficiency", help="placement efficiency and its history")
    eff.add_argument("--history", type=int, default=20, help="samples of history shown")
    eff.set_defaults(run=cmd_efficiency)
    sub.add_parser(
        "plan", help="dry run of the planning pass: its moves, and whether it would propose them"
    ).set_defaults(run=cmd_plan)
    for name, helptext, run in (
        ("rebalance", "plan and execute the moves to the best placement", cmd_rebalance),
        ("drain", "move every worker off a node", cmd_drain),
        ("move", "move one worker", cmd_move),
    ):
        cmd = sub.add_parser(name, help=helptext)
        if name == "drain":
            cmd.add_argument("node", help="the node to empty (it is cordoned first)")
        if name == "move":
            cmd.add_argument("worker", help="the worker's id (fleetshift workers)")
            cmd.add_argument("--to", required=True, help="target node")
            cmd.add_argument("--gpus", default="", help="e.g. 0,1,2,3 (empty: lowest free)")
            cmd.add_argument(
                "--role",
                default="",
                choices=["", "prefill", "decode", "mixed"],
                help="the role it serves there (empty: keep its role)",
            )
        cmd.add_argument("--key", default="", help="idempotency key: a retry runs once")
        cmd.add_argument("--reason", default="", help="recorded in the audit history")
        cmd.add_argument("--watch", action="store_true", help="follow with live progress")
        cmd.set_defaults(run=run)
    opers = sub.add_parser("operations", help="the audit history, or one operation by id")
    opers.add_argument("id", nargs="?", default="", help="an operation id (empty: list them)")
    opers.add_argument("--limit", type=int, default=20, help="operations listed")
    opers.add_argument("--watch", action="store_true", help="follow the operation live")
    opers.set_defaults(run=cmd_operations)
    cancel = sub.add_parser("cancel", help="cancel an operation (steps not started are skipped)")
    cancel.add_argument("id", help="the operation id")
    cancel.set_defaults(run=cmd_cancel)
    calibrate.register(sub, open_channel)
    local = sub.add_parser(
        "local-fleet",
        help="run a daemon + agents with declared GPUs here, optionally models and workers",
        description="A daemon on SQLite and four agents with declared GPUs (a100-1, h100-1, "
        "h100-2, h200-1), each a process of its own; with --preset or --model, workers of the "
        "model on them, and with --gateway the OpenAI-compatible gateway in front.",
        formatter_class=HELP_FORMAT,
    )
    local.add_argument(
        "--state-dir", default="", help="state and logs (default: a new temporary directory)"
    )
    local.add_argument(
        "--preset",
        action="append",
        default=[],
        choices=["tiny", "small"],
        help="make a seeded reference model of this preset, served under that name (repeatable)",
    )
    local.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve a reference-engine model directory under NAME (repeatable)",
    )
    local.add_argument("--workers", type=int, default=1, help="mixed workers started per model")
    local.add_argument(
        "--gateway", action="store_true", help="start the OpenAI-compatible gateway too"
    )
    local.add_argument(
        "--keep", action="store_true", help="keep running until Ctrl-C, SIGTERM or SIGHUP"
    )
    local.set_defaults(run=cmd_local_fleet)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:  # fleetshift certs init-ca|issue-node|issue-operator ...
        return pki.main(argv[1:])
    if argv[:1] == ["simulate"]:  # fleetshift simulate --trace CSV --fleet TOML --policy all ...
        from fleetshift_daemon.sim.cli import main as simulate

        return int(simulate(argv[1:]) or 0)
    if argv[:1] == ["calibration"]:  # fleetshift calibration --fit A:a.json --check B:b.json
        from fleetshift_daemon.cli.calibration import main as calibration

        return calibration(argv[1:])
    if argv[:1] == ["profile"]:  # fleetshift profile --worker HOST:PORT --config DIR --out CSV
        from fleetshift_daemon.cli.profile import main as profile

        return profile(argv[1:])
    if argv[:1] == ["demo"]:  # fleetshift demo [--short] [--keep] [--trace CSV] ...
        from fleetshift_daemon.demo.main import main as demo

        return demo(argv[1:])
    if argv[:1] == ["gateway"]:  # fleetshift gateway --daemon ADDR --model NAME=DIR ...
        from fleetshift_gateway.main import main as gateway

        return gateway(argv[1:])
    args = _parser().parse_args(argv)
    replicas = args.daemon
    for attempt in range(STALE_LEADER_RETRIES + 1):
        try:
            return int(args.run(args))
        except grpc.RpcError as err:
            leader = leader_hint(err)
            if not leader or leader == args.daemon:
                return _failed(args, err)
        # A follower under TLS names the leader instead of forwarding (docs/replicas.md).
        console.print(f"[yellow]the leader is at {leader}[/]: sending the command there")
        args.daemon = leader
        try:
            return int(args.run(args))
        except grpc.RpcError as err:
            if attempt == STALE_LEADER_RETRIES or not _never_reached(err):
                return _failed(args, err)
        # Just after a takeover a follower can still name the leader that died (its view of
        # the lease lags the database by up to a refresh): ask the replicas again shortly.
        console.print(f"[yellow]no daemon answers at {leader}[/]: asking the replicas again")
        args.daemon = replicas
        time.sleep(STALE_LEADER_WAIT_S)
    return 1  # not reached: the last attempt returns above


# A follower's leader hint that names a dead daemon is asked again this often, this long apart:
# a few of its view's refreshes, well inside a lease.
STALE_LEADER_RETRIES = 5
STALE_LEADER_WAIT_S = 1.0


def _never_reached(err: grpc.RpcError) -> bool:
    """UNAVAILABLE because no connection was made: the command never reached a daemon, so
    sending it again cannot apply it twice."""
    details = (err.details() or "").lower()
    return err.code() == grpc.StatusCode.UNAVAILABLE and (
        "failed to connect" in details or "connection refused" in details
    )


def _failed(args: argparse.Namespace, err: grpc.RpcError) -> int:
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        console.print(unreachable(args.daemon, args.daemon_given, err.details() or ""))
    else:
        console.print(f"[red]{err.code().name}[/]: {err.details()}")
    return 1


def unreachable(address: str, given: bool, details: str) -> str:
    """Name the flag and the variable that choose the daemon, not just the socket error."""
    where = "" if given else " (the default; no --daemon given and FLEETSHIFT_DAEMON unset)"
    return (
        f"[red]UNAVAILABLE[/]: no FleetShift daemon answers at {address}{where}. Pass "
        "--daemon HOST:PORT or set FLEETSHIFT_DAEMON; `./scripts/demo --keep` and "
        f"`fleetshift local-fleet --keep` print their daemon's address. ({details})"
    )


if __name__ == "__main__":
    sys.exit(main())
