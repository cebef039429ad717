"""workers, operations and efficiency history

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 09:28:19.622866
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "efficiency_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("taken_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("efficiency", sa.Float(), nullable=False),
        sa.Column("current_goodput", sa.Float(), nullable=False),
        sa.Column("best_goodput", sa.Float(), nullable=False),
        sa.Column("plan_proposed", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_efficiency_samples")),
    )
    with op.batch_alter_table("efficiency_samples", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_efficiency_samples_taken_at"), ["taken_at"], unique=False
        )

    op.create_table(
        "operations",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("requested_by", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.String(length=1024), nullable=False),
        sa.Column("idempotency_key", sa.String(length=128), nullable=True),
        sa.Column("request_digest", sa.String(length=64), nullable=False),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("error", sa.String(length=2048), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_operations_idempotency_key")),
    )
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_operations_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_operations_state"), ["state"], unique=False)

    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=63), nullable=False),
        sa.Column("node_name", sa.String(length=63), nullable=False),
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("tensor_parallel", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("gpu_indices", sa.String(length=256), nullable=False),
        sa.Column("endpoint", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("origin_snapshot", sa.String(length=128), nullable=False),
        sa.Column("operation_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_workers_node_name"), ["node_name"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_workers_node_name"))

    op.drop_table("workers")
    with op.batch_alter_table("operations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_operations_state"))
        batch_op.drop_index(batch_op.f("ix_operations_created_at"))

    op.drop_table("operations")
    with op.batch_alter_table("efficiency_samples", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_efficiency_samples_taken_at"))

    op.drop_table("efficiency_samples")
