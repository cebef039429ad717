"""A cheap mark of what a follower's view is read from: equal marks, nothing to re-read.

A follower re-read every node, GPU, worker and operation each ``view_refresh_s``: at 1,000
nodes about 11,000 rows through the ORM five times a second, which took half of a follower's
samples under py-spy and starved the leader it shares the machine with (registering 1,000 nodes
at the leader did not finish in 600 s beside one follower; 134 s alone). The mark is computed
by PostgreSQL in one statement and one row: per table, the row count and the sum of a 64-bit
hash of each row's ``xmin`` (the transaction that wrote the row version: an insert, update or
delete changes the sum or the count), and for ``nodes``, whose heartbeat times the leader
rewrites every sweep, a digest of the durable columns instead.

Why hashed: a plain sum of ``xmin`` can stay the same across a change. Transaction ids are
taken when a transaction first writes, not when it commits, so an older transaction that
commits late can rewrite one row to a smaller id and another to a larger one, the two
differences cancelling (``tests/replicas/test_view_mark.py`` builds such a pair). With hashed
ids a missed change needs two 64-bit hashes to cancel, so the mark is what decides a re-read,
and the periodic full read (``replicas.view_full_read_s``) is defence in depth, not
correctness. A changed mark can be spurious (a row rewritten with the same values): that costs
one needless re-read, never a missed change. SQLite serves one daemon, which never follows: no
mark (None), the caller reads as before.
"""

from __future__ import annotations

from sqlalchemy import Engine, text

# Per table, the mark's part: for ``nodes`` a digest of every column but the heartbeat time (what
# Registry.refresh compares; tests/replicas/test_view_mark.py checks each column), for the
# others the row count and the sum of the rows' hashed ``xmin``.
_MARK = text(
    """
    SELECT
      (SELECT md5(coalesce(string_agg(concat_ws('|', id, name, agent_address, state, cordoned,
              cordon_reason, inventory_source, driver_version, cuda_version, torch_version,
              agent_version, registered_at), ',' ORDER BY id), '')) FROM nodes),
      (SELECT count(*)::text || ':'
              || coalesce(sum(hashint8extended(xmin::text::bigint, 0)::numeric), 0)::text
         FROM gpus),
      (SELECT count(*)::text || ':'
              || coalesce(sum(hashint8extended(xmin::text::bigint, 0)::numeric), 0)::text
         FROM workers),
      (SELECT count(*)::text || ':'
              || coalesce(sum(hashint8extended(xmin::text::bigint, 0)::numeric), 0)::text
         FROM operations)
    """
)


# What each part of the mark covers, in the mark's order: the registry is read from nodes and
# gpus together, the worker table and the operation log each from their own table.
MARK_PARTS = ("registry", "registry", "workers", "operations")
VIEWS = frozenset(MARK_PARTS)


def stale_views(before: tuple[str, ...] | None, now: tuple[str, ...] | None) -> frozenset[str]:
    """The views a follower must re-read between two marks: those whose tables' parts differ,
    and every view where either mark is missing (SQLite, or no read yet). An executor's step
    rewrites its operation several times a move; re-reading the registry for each of those
    cost a follower 0.64 s of CPU at 1,000 nodes (bench/follower_reads.py, 2026-12-05)."""
    if before is None or now is None:
        return VIEWS
    return frozenset(part for part, a, b in zip(MARK_PARTS, before, now, strict=True) if a != b)


def view_mark(engine: Engine) -> tuple[str, ...] | None:
    """The mark now; None where there is none to take (SQLite)."""
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as conn:
        row = conn.execute(_MARK).one()
    return tuple(str(v) for v in row)
