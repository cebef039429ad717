"""nodes and gpus of the fleet registry

Revision ID: 0001
Revises:
Create Date: 2026-11-30 09:19:13.281808
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=63), nullable=False),
        sa.Column("agent_address", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("cordoned", sa.Boolean(), nullable=False),
        sa.Column("cordon_reason", sa.String(length=512), nullable=False),
        sa.Column("inventory_source", sa.String(length=16), nullable=False),
        sa.Column("driver_version", sa.String(length=128), nullable=False),
        sa.Column("cuda_version", sa.String(length=128), nullable=False),
        sa.Column("torch_version", sa.String(length=128), nullable=False),
        sa.Column("agent_version", sa.String(length=128), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_nodes")),
        sa.UniqueConstraint("name", name=op.f("uq_nodes_name")),
    )
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("product_name", sa.String(length=128), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger(), nullable=False),
        sa.Column("bandwidth_class", sa.String(length=32), nullable=False),
        sa.Column("compute_capability", sa.String(length=8), nullable=False),
        sa.Column("fp8_supported", sa.Boolean(), nullable=False),
        sa.Column("nvlink_peers", sa.String(length=256), nullable=False),
        sa.Column("uuid", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_gpus_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
        sa.UniqueConstraint("node_id", "index", name="uq_gpus_node_id_index"),
    )
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_gpus_node_id"), ["node_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("gpus", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_gpus_node_id"))

    op.drop_table("gpus")
    op.drop_table("nodes")
