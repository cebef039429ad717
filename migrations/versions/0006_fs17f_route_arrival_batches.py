"""route arrivals: each row carries its replica's publication number, so a retried
publication cannot be counted twice

Revision ID: 0006_fs17f
Revises: 0005_fs17
Create Date: 2026-12-04 09:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_fs17f"
down_revision: str | None = "0005_fs17"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable: rows an older replica wrote have no number, and NULLs never collide in a
    # unique index (SQLite and PostgreSQL alike), so the upgrade works on a live table.
    op.add_column("route_arrivals", sa.Column("batch", sa.BigInteger(), nullable=True))
    op.create_index(
        op.f("ux_route_arrivals_replica_batch"),
        "route_arrivals",
        ["replica", "batch", "model"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index(op.f("ux_route_arrivals_replica_batch"), table_name="route_arrivals")
    with op.batch_alter_table("route_arrivals") as batch:  # SQLite drops a column by copying
        batch.drop_column("batch")
