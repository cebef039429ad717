"""``fleetshift-agent``: the node agent."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import sys

from fleetshift_agent.app import Agent
from fleetshift_common.config import ConfigError, agent_config
from fleetshift_common.errors import FleetShiftError
from fleetshift_common.lifecycle import stop_event
from fleetshift_common.logs import setup_logging

log = logging.getLogger("fleetshift.agent")


async def _serve(agent: Agent) -> None:
    stopping = stop_event()
    await agent.start()
    await stopping.wait()
    log.info("stopping")
    await agent.stop()


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()  # a watchdog SIGABRT leaves a Python traceback in the journal
    parser = argparse.ArgumentParser(prog="fleetshift-agent", description=__doc__)
    parser.add_argument("--config", help="TOML file (env FLEETSHIFT_AGENT_<KEY> overrides it)")
    args = parser.parse_args(argv)
    try:
        config = agent_config(args.config)
    except ConfigError as err:
        print(f"fleetshift-agent: {err}", file=sys.stderr)
        return 2
    setup_logging(config.log_format)
    try:
        asyncio.run(_serve(Agent(config)))
    except FleetShiftError as err:  # e.g. inventory = "nvml" on a machine without NVML
        log.error("agent cannot start: %s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
