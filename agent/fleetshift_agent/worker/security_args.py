"""The security flags of a worker process, one definition for every engine.

The reference worker (``fleetshift_agent.worker``) and the vLLM shim
(``fleetshift_agent.vllm_worker``) take the same flags from the supervisor and build the same
server security from them (``fleetshift_rpc.auth.worker_security``): mTLS with the node's
certificate, control calls from the daemon and that node's own agent only, sessions from the
listed callers; without TLS, plaintext on loopback only (docs/security.md).
"""

from __future__ import annotations

import argparse

from fleetshift_rpc.auth import ServerSecurity, worker_security
from fleetshift_rpc.security import TlsFiles


def add_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--node-name",
        default="",
        help="the node this worker belongs to: its certificate must name it, and only that "
        "node's agent (besides the daemon) may make control calls",
    )
    p.add_argument("--tls-cert", default="", help="the node's certificate (mTLS); none: plaintext")
    p.add_argument("--tls-key", default="")
    p.add_argument("--tls-ca", default="", help="the fleet CA bundle")
    p.add_argument(
        "--session-caller",
        action="append",
        default=[],
        metavar="KIND:NAME",
        help="a certificate identity allowed to open sessions (repeatable; 'router:*' for "
        "any router certificate of the fleet CA)",
    )


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """Checked before the engine loads: a bad key, certificate or address fails in
    milliseconds, naming it, not after the model has loaded."""
    return worker_security(
        listen=args.listen,
        node_name=args.node_name,
        tls=TlsFiles.from_config(args.tls_cert, args.tls_key, args.tls_ca),
        session_callers=tuple(args.session_caller),
    )
