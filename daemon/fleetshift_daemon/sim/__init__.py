"""Replay of real request traces on a simulated fleet, timed by the daemon's performance model.

It exists to show, before anyone moves a real worker, whether a placement pays: every policy
runs on the same trace and fleet, and every figure it reports comes from one run.
"""
