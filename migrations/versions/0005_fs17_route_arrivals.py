"""route arrivals: each daemon replica's Route observations, for the leader's traffic window

Revision ID: 0005_fs17
Revises: 0004_fs17b
Create Date: 2026-12-02 06:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_fs17"
down_revision: str | None = "0004_fs17b"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "route_arrivals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("replica", sa.String(length=128), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_route_arrivals")),
    )
    op.create_index(
        op.f("ix_route_arrivals_created_at"), "route_arrivals", ["created_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_route_arrivals_created_at"), table_name="route_arrivals")
    op.drop_table("route_arrivals")
