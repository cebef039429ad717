"""Adapters from the core's protocols to the processes the daemon talks to."""
