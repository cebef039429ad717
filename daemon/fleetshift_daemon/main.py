"""``fleetshiftd``: run the daemon, or only upgrade its database schema."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import sys

from fleetshift_common.config import ConfigError, daemon_config
from fleetshift_common.lifecycle import stop_event
from fleetshift_common.logs import setup_logging
from fleetshift_daemon.app import Daemon

log = logging.getLogger("fleetshift.daemon")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetshiftd", description=__doc__)
    parser.add_argument("--config", help="TOML file (env FLEETSHIFTD_<KEY> overrides it)")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("serve", help="run the daemon (default)")
    sub.add_parser("migrate", help="upgrade the database schema to the newest revision and exit")
    revision = sub.add_parser("revision", help="(developers) autogenerate a new migration")
    revision.add_argument("-m", "--message", required=True)
    return parser


async def _serve(daemon: Daemon) -> None:
    stopping = stop_event()
    await daemon.start()
    await stopping.wait()
    log.info("stopping")
    await daemon.stop()


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()  # a watchdog SIGABRT leaves a Python traceback in the journal
    args = _parser().parse_args(argv)
    try:
        config = daemon_config(args.config)
    except ConfigError as err:
        print(f"fleetshiftd: {err}", file=sys.stderr)
        return 2
    setup_logging(config.log_format)
    from fleetshift_daemon.store import database

    if args.command == "migrate":
        engine = database.make_engine(config.effective_database_url)
        database.upgrade(engine)
        print(f"schema at revision {database.current_revision(engine)}")
        return 0
    if args.command == "revision":
        from alembic import command

        engine = database.make_engine(config.effective_database_url)
        with engine.connect() as conn:
            command.revision(database.alembic_config(conn), args.message, autogenerate=True)
        return 0
    try:
        asyncio.run(_serve(Daemon(config)))
    except ConfigError as err:  # security keys are checked when the servers are built
        log.error("fleetshiftd: %s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
