"""The inference worker process: the reference engine behind ``fleetshift.v1.WorkerService``.

It runs as its own OS process so that a crash, a SIGKILL or a restore from a snapshot is a
real process boundary, exactly what the node agent supervises in production.
"""
