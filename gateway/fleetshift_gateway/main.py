"""``fleetshift gateway``: serve the OpenAI API in front of a FleetShift daemon.

Each ``--model NAME=DIR`` names a model the daemon serves and the directory holding its
``tokenizer.json`` and ``config.json``; ``--daemon-config`` reads them from the daemon's own
TOML instead (every ``[[models]]`` entry with a ``model_dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

import grpc
import uvicorn
from prometheus_client import start_http_server

from fleetshift_common.config import ConfigError, daemon_config
from fleetshift_common.helpformat import DefaultsHelpFormatter, plain_description
from fleetshift_common.logs import setup_logging
from fleetshift_gateway.app import DEFAULT_MAX_BODY_BYTES, Gateway, build_app
from fleetshift_gateway.metrics import GatewayMetrics
from fleetshift_gateway.routes import DEFAULT_ROUTE_CACHE_S
from fleetshift_gateway.tokenizer import ModelTokenizer
from fleetshift_gateway.upstream import MAX_MESSAGE_BYTES, WorkerChannels
from fleetshift_rpc.replicas import aio_daemon_channel
from fleetshift_rpc.security import client_credentials

log = logging.getLogger("fleetshift.gateway")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fleetshift gateway",
        description=plain_description(__doc__),
        formatter_class=DefaultsHelpFormatter,
    )
    env = os.environ.get
    p.add_argument(
        "--daemon",
        default=env("FLEETSHIFT_DAEMON", "127.0.0.1:50051"),
        help="the daemon's HOST:PORT, or every replica's, comma-separated (env FLEETSHIFT_DAEMON)",
    )
    p.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0: any free one)")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: none)")
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a model the daemon serves and the directory of its tokenizer.json and config.json "
        "(repeatable)",
    )
    p.add_argument("--daemon-config", type=Path, help="read models and model_dir from it")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="a larger request body is refused with 400",
    )
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop: uvloop is libuv's; asyncio's own is pure Python",
    )
    p.add_argument(
        "--http",
        choices=("httptools", "h11"),
        default="httptools",
        help="HTTP/1.1 parser: httptools is C; h11 is pure Python",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=int,
        default=20,
        help="on SIGTERM, seconds streams in flight get to finish",
    )
    p.add_argument(
        "--route-cache-s",
        type=float,
        default=DEFAULT_ROUTE_CACHE_S,
        help="reuse the daemon's Route answer for a request of the same model and shape this "
        "long (every request is still counted by its own Route call, sent after its first "
        "token); 0: every request waits for its own Route",
    )
    p.add_argument("--token-file", type=Path, help="require this bearer token on /v1 requests")
    p.add_argument("--tls-cert", default="", help="serve HTTPS with this certificate (PEM)")
    p.add_argument("--tls-key", default="", help="and its private key")
    p.add_argument(
        "--daemon-ca", default="", help="dial the daemon over TLS, trusting this CA (PEM)"
    )
    p.add_argument(
        "--daemon-cert",
        default="",
        help="with --daemon-key: the gateway's client certificate for the daemon's mTLS port "
        "(`fleetshift certs issue-router DIR NAME`)",
    )
    p.add_argument("--daemon-key", default="", help="the private key of --daemon-cert")
    p.add_argument(
        "--daemon-tls-name",
        default="",
        help="with a replica list: the name every replica's certificate carries (default: the "
        "first replica's host)",
    )
    return p


def fleet_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """None for a loopback development fleet; else the router certificate, the identity the
    daemon lets call Route and LocateSession and the workers let open sessions."""
    if not args.daemon_ca:
        if args.daemon_cert or args.daemon_key:
            raise SystemExit("--daemon-cert and --daemon-key need --daemon-ca")
        return None
    try:
        return client_credentials(args.daemon_ca, args.daemon_cert, args.daemon_key)
    except (ConfigError, OSError) as err:
        raise SystemExit(f"the daemon's TLS files: {err}") from err


def daemon_channel(
    args: argparse.Namespace, creds: grpc.ChannelCredentials | None
) -> grpc.aio.Channel:
    """One daemon, or every replica of a comma-separated list on one channel that fails over."""
    return aio_daemon_channel(args.daemon, MAX_MESSAGE_BYTES, creds, args.daemon_tls_name)


def load_models(args: argparse.Namespace) -> dict[str, ModelTokenizer]:
    dirs: dict[str, Path] = {}
    if args.daemon_config:
        for model in daemon_config(args.daemon_config, {}).models:
            if model.model_dir:
                dirs[model.name] = Path(model.model_dir)
    for spec in args.model:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise SystemExit(f"--model wants NAME=DIR, got {spec!r}")
        dirs[name] = Path(folder)
    if not dirs:
        raise SystemExit("no model to serve: give --model NAME=DIR or --daemon-config")
    return {name: ModelTokenizer.load(name, folder) for name, folder in dirs.items()}


async def run(args: argparse.Namespace) -> None:
    models = load_models(args)
    host, _, port = args.listen.rpartition(":")
    host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(1024)  # connections queue from here on, before uvicorn takes the socket
    metrics = GatewayMetrics()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=host, registry=metrics.registry)
    creds = fleet_credentials(args)
    async with daemon_channel(args, creds) as daemon:
        token = args.token_file.read_text().strip() if args.token_file else ""
        gw = Gateway(
            daemon,
            models,
            args.max_body_bytes,
            metrics,
            WorkerChannels(creds),
            token=token,
            route_cache_s=args.route_cache_s,
        )
        config = uvicorn.Config(
            build_app(gw),
            log_level="warning",
            access_log=False,
            http=args.http,
            timeout_graceful_shutdown=args.shutdown_timeout,
            ssl_certfile=args.tls_cert or None,
            ssl_keyfile=args.tls_key or None,
        )
        bound = sock.getsockname()[1]
        log.info("gateway on %s:%d for %s, daemon %s", host, bound, sorted(models), args.daemon)
        if args.port_file:
            args.port_file.write_text(f"{bound}\n")
        try:
            await uvicorn.Server(config).serve(sockets=[sock])
        finally:
            await gw.router.close()
            await gw.channels.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 0 <= args.route_cache_s <= 60:  # also refuses nan
        raise SystemExit(f"--route-cache-s must be 0 to 60 seconds, got {args.route_cache_s}")
    setup_logging()
    with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
        runner.run(run(args))
    return 0


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when asked and installed (the gateway extra installs it); asyncio's otherwise.
    grpc.aio runs on either: it needs only the loop's reader callbacks."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed: running on asyncio's own event loop")
            return None
        return uvloop.new_event_loop
    return None


if __name__ == "__main__":
    raise SystemExit(main())
