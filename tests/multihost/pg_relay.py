"""A TCP front for the machine's PostgreSQL, run inside the lab's "database host" namespace.

``python -m tests.multihost.pg_relay HOST:PORT UNIX_SOCKET``: listens on the lab address and
relays each connection to PostgreSQL's unix socket (a file, reachable from any network
namespace). Daemons in other namespaces thus reach the database only across the lab's bridge,
so taking a host's link down cuts it off the database as a real network fault would.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(ConnectionError, OSError):
        writer.close()


async def main(listen: str, socket_path: str) -> None:
    host, _, port = listen.rpartition(":")

    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            db_r, db_w = await asyncio.open_unix_connection(socket_path)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, db_w), _pipe(db_r, client_w))

    server = await asyncio.start_server(relay, host, int(port))
    print(f"relaying {listen} -> {socket_path}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
