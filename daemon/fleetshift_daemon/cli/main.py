"""``fleetshift``: the operator's command line.

It speaks only the public gRPC API, exactly like grpcurl would, so anything it shows an
operator can also be scripted against the daemon directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import grpc
from rich.console import Console

from fleetshift.v1 import fleet_pb2 as pb
from fleetshift.v1 import fleet_pb2_grpc as pb_grpc
from fleetshift_daemon.cli.tables import nodes_table
from fleetshift_daemon.localfleet import LocalFleet

# Piped output (CI logs, the README demo) is not a terminal: keep tables wide enough to read.
console = Console(width=None if sys.stdout.isatty() else 140)


def _operator(address: str) -> tuple[grpc.Channel, pb_grpc.FleetOperatorStub]:
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.FleetOperatorStub(ch)


def cmd_nodes(args: argparse.Namespace) -> int:
    ch, stub = _operator(args.daemon)
    with ch:
        reply = stub.ListNodes(pb.ListNodesRequest(), timeout=args.timeout)
    console.print(nodes_table(reply.nodes))
    return 0


def cmd_cordon(args: argparse.Namespace) -> int:
    ch, stub = _operator(args.daemon)
    with ch:
        if args.command == "cordon":
            node = stub.CordonNode(
                pb.CordonNodeRequest(node_name=args.node, reason=args.reason), timeout=args.timeout
            )
        else:
            node = stub.UncordonNode(
                pb.UncordonNodeRequest(node_name=args.node), timeout=args.timeout
            )
    console.print(nodes_table([node]))
    return 0


def cmd_local_fleet(args: argparse.Namespace) -> int:
    fleet = LocalFleet(Path(args.state_dir).resolve())
    console.print(f"starting a local fleet under {fleet.state_dir} (logs in logs/) ...")
    try:
        fleet.start(timeout_s=args.timeout)
        console.print(f"daemon listening on {fleet.daemon_address} (grpcurl -plaintext ...)")
        console.print(nodes_table(fleet.list_nodes()))
        if args.keep:
            console.print("running; Ctrl-C stops the fleet")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        fleet.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetshift", description=__doc__)
    parser.add_argument(
        "--daemon",
        default=os.environ.get("FLEETSHIFT_DAEMON", "127.0.0.1:50051"),
        help="daemon address (env FLEETSHIFT_DAEMON)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes", help="list the fleet's nodes").set_defaults(run=cmd_nodes)
    cordon = sub.add_parser("cordon", help="stop placing work on a node")
    cordon.add_argument("node")
    cordon.add_argument("--reason", default="")
    cordon.set_defaults(run=cmd_cordon)
    uncordon = sub.add_parser("uncordon", help="allow work on a node again")
    uncordon.add_argument("node")
    uncordon.set_defaults(run=cmd_cordon)
    local = sub.add_parser("local-fleet", help="run a daemon + agents with declared GPUs here")
    local.add_argument("--state-dir", default="state/local-fleet")
    local.add_argument("--keep", action="store_true", help="keep running until Ctrl-C")
    local.set_defaults(run=cmd_local_fleet)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except grpc.RpcError as err:
        console.print(f"[red]{err.code().name}[/]: {err.details()}")  # type: ignore[attr-defined]
        return 1


if __name__ == "__main__":
    sys.exit(main())
