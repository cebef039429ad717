"""``fleetshift demo``: the main job end to end on one machine (``./scripts/demo``)."""
