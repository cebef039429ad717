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
from fleetshift_rpc import pki
from fleetshift_rpc.security import client_credentials

# Piped output (CI logs, the README demo) is not a terminal: keep tables wide enough to read.
console = Console(width=None if sys.stdout.isatty() else 140)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext to a loopback development daemon; TLS (+ certificate or token) otherwise."""
    if not args.ca:
        return grpc.insecure_channel(args.daemon)
    creds = client_credentials(args.ca, args.cert, args.key, args.token)
    return grpc.secure_channel(args.daemon, creds)


def _operator(args: argparse.Namespace) -> tuple[grpc.Channel, pb_grpc.FleetOperatorStub]:
    ch = open_channel(args)
    return ch, pb_grpc.FleetOperatorStub(ch)


def cmd_nodes(args: argparse.Namespace) -> int:
    ch, stub = _operator(args)
    with ch:
        reply = stub.ListNodes(pb.ListNodesRequest(), timeout=args.timeout)
    console.print(nodes_table(reply.nodes))
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
    env = os.environ.get
    parser.add_argument(
        "--ca", default=env("FLEETSHIFT_CA", ""), help="fleet CA (env FLEETSHIFT_CA)"
    )
    parser.add_argument("--cert", default=env("FLEETSHIFT_CERT", ""), help="operator certificate")
    parser.add_argument("--key", default=env("FLEETSHIFT_KEY", ""), help="its private key")
    parser.add_argument(
        "--token", default=env("FLEETSHIFT_TOKEN", ""), help="bearer token (env FLEETSHIFT_TOKEN)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("nodes", help="list the fleet's nodes").set_defaults(run=cmd_nodes)
    sub.add_parser("certs", help="issue a CA and certificates: fleetshift certs --help")
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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["certs"]:  # fleetshift certs init-ca|issue-node|issue-operator ...
        return pki.main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except grpc.RpcError as err:
        console.print(f"[red]{err.code().name}[/]: {err.details()}")  # type: ignore[attr-defined]
        return 1


if __name__ == "__main__":
    sys.exit(main())
