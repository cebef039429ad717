"""leader lease: one row replicas compete for, with a fencing token

Revision ID: 0004_fs17b
Revises: 0003
Create Date: 2026-12-01 22:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0004_fs17b"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    lease = op.create_table(
        "leader_lease",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=False),
        sa.Column("address", sa.String(length=255), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("renewed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leader_lease")),
    )
    long_ago = datetime(1970, 1, 1, tzinfo=UTC)  # expired: the first replica takes it
    op.bulk_insert(
        lease,
        [{"id": 1, "holder": "", "address": "", "token": 0, "expires_at": long_ago,
          "renewed_at": long_ago}],
    )  # fmt: skip


def downgrade() -> None:
    op.drop_table("leader_lease")
