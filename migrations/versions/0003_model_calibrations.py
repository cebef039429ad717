"""model calibrations: per-(model, GPU kind) fits of uploaded profiles

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 19:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_calibrations",
        sa.Column("model", sa.String(length=128), nullable=False),
        sa.Column("gpu_kind", sa.String(length=64), nullable=False),
        sa.Column("factors", sa.JSON(), nullable=False),
        sa.Column("hardware", sa.String(length=255), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("median_error_pct", sa.Float(), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=False),
        sa.Column("profiled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uploaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model", "gpu_kind", name=op.f("pk_model_calibrations")),
    )


def downgrade() -> None:
    op.drop_table("model_calibrations")
