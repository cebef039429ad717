"""An operator with nothing but grpcurl, the fleet CA and a token (or a certificate)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.security.conftest import OPERATOR_TOKEN, Certs, registration, secure_fleet


async def grpcurl_run(grpcurl: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        grpcurl,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=30)
    return proc.returncode or 0, out.decode()


async def test_grpcurl_with_a_token_on_the_tls_port(
    tmp_path: Path, certs: Certs, grpcurl: str
) -> None:
    async with secure_fleet(tmp_path, certs) as fleet:
        async with fleet.channel(certs.node_a) as ch:
            await fleet.agents(ch).RegisterNode(registration("node-a"))
        target = f"127.0.0.1:{fleet.tls.port}"
        tls = ["-cacert", str(certs.ca)]
        bearer = ["-H", f"authorization: Bearer {OPERATOR_TOKEN}"]

        code, out = await grpcurl_run(grpcurl, *tls, target, "list")  # reflection is public
        assert code == 0 and "fleetshift.v1.FleetOperator" in out, out

        cordon = ["-d", '{"node_name": "node-a", "reason": "firmware"}']
        method = "fleetshift.v1.FleetOperator/CordonNode"
        code, out = await grpcurl_run(grpcurl, *tls, *cordon, target, method)
        assert code != 0 and "Unauthenticated" in out, out
        assert not fleet.registry.get("node-a").cordoned

        code, out = await grpcurl_run(grpcurl, *tls, *bearer, *cordon, target, method)
        assert code == 0, out
        assert json.loads(out)["cordoned"] is True
        assert fleet.registry.get("node-a").cordon_reason == "firmware"

        # the mTLS port with the operator's certificate instead of a token
        mtls = [*tls, "-cert", str(certs.operator.cert), "-key", str(certs.operator.key)]
        target = f"127.0.0.1:{fleet.mtls.port}"
        code, out = await grpcurl_run(
            grpcurl, *mtls, "-d", "{}", target, "fleetshift.v1.FleetOperator/ListNodes"
        )
        assert code == 0 and json.loads(out)["nodes"][0]["name"] == "node-a", out
