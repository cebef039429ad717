"""SQL schema of the fleet registry (SQLAlchemy 2 typed models).

Alembic migrations in migrations/ are the only way this schema reaches a database; a test
checks that a freshly migrated database matches these models exactly.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(63), unique=True)
    agent_address: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    cordon_reason: Mapped[str] = mapped_column(String(512), default="")
    inventory_source: Mapped[str] = mapped_column(String(16))
    driver_version: Mapped[str] = mapped_column(String(128), default="")
    cuda_version: Mapped[str] = mapped_column(String(128), default="")
    torch_version: Mapped[str] = mapped_column(String(128), default="")
    agent_version: Mapped[str] = mapped_column(String(128), default="")
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    gpus: Mapped[list[GpuRow]] = relationship(
        back_populates="node", cascade="all, delete-orphan", order_by="GpuRow.index"
    )


class GpuRow(Base):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index", name="uq_gpus_node_id_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    product_name: Mapped[str] = mapped_column(String(128))
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    bandwidth_class: Mapped[str] = mapped_column(String(32), default="")
    compute_capability: Mapped[str] = mapped_column(String(8), default="")
    fp8_supported: Mapped[bool] = mapped_column(Boolean, default=False)
    nvlink_peers: Mapped[str] = mapped_column(String(256), default="")  # "1,2,3"
    uuid: Mapped[str] = mapped_column(String(64), default="")

    node: Mapped[NodeRow] = relationship(back_populates="gpus")


class WorkerRow(Base):
    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(63), primary_key=True)
    node_name: Mapped[str] = mapped_column(String(63), index=True)
    model: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    tensor_parallel: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    gpu_indices: Mapped[str] = mapped_column(String(256), default="")  # "0,1,2,3"
    endpoint: Mapped[str] = mapped_column(String(255))
    state: Mapped[str] = mapped_column(String(16))
    origin_snapshot: Mapped[str] = mapped_column(String(128), default="")
    operation_id: Mapped[str] = mapped_column(String(64), default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class OperationRow(Base):
    """The audit history: one row per operation, its steps as JSON (they move together)."""

    __tablename__ = "operations"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), index=True)
    requested_by: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(String(1024), default="")
    idempotency_key: Mapped[str | None] = mapped_column(String(128), unique=True)
    request_digest: Mapped[str] = mapped_column(String(64), default="")
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[str] = mapped_column(String(2048), default="")
    steps: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class EfficiencySampleRow(Base):
    """The placement efficiency figure over time: the alarm that a placement went wrong."""

    __tablename__ = "efficiency_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    taken_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    efficiency: Mapped[float] = mapped_column(Float)
    current_goodput: Mapped[float] = mapped_column(Float)
    best_goodput: Mapped[float] = mapped_column(Float)
    plan_proposed: Mapped[bool] = mapped_column(Boolean, default=False)


class ModelCalibrationRow(Base):
    """A model's calibration on one GPU kind, fitted on a profile the operator uploaded."""

    __tablename__ = "model_calibrations"

    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    gpu_kind: Mapped[str] = mapped_column(String(64), primary_key=True)
    factors: Mapped[dict[str, Any]] = mapped_column(JSON)  # KindFactors.to_dict()
    hardware: Mapped[str] = mapped_column(String(255))  # the profile's hardware column
    rows: Mapped[int] = mapped_column(Integer)
    median_error_pct: Mapped[float] = mapped_column(Float)
    errors: Mapped[list[dict[str, Any]]] = mapped_column(JSON)  # per phase
    profiled_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    uploaded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class LeaderLeaseRow(Base):
    """The one lease replicas compete for (id 1): its holder, address, token and expiry.

    ``token`` grows by one at every change of holder; executor writes check it in their own
    transaction (store/lease_store.py), so a deposed leader's writes are refused."""

    __tablename__ = "leader_lease"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    holder: Mapped[str] = mapped_column(String(128), default="")
    address: Mapped[str] = mapped_column(String(255), default="")
    token: Mapped[int] = mapped_column(BigInteger, default=0)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    renewed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class RouteArrivalRow(Base):
    """One replica's Route arrivals of one model over one publishing interval (migration
    0005_fs17). ``payload`` is ``[[age_s, prompt_tokens, output_tokens], ...]``, each age
    counted back from ``created_at`` (the database's clock), so no two hosts' clocks are
    compared; every replica, leader included, publishes what it answered and folds the other
    replicas' rows into its traffic window (``traffic_share.py``)."""

    __tablename__ = "route_arrivals"
    # A replica numbers its publications; a retried one (its first attempt's commit may have
    # landed although the call failed) is refused as a duplicate instead of counted twice
    # (migration 0006_fs17f). Rows written before it have no number (NULLs never collide).
    __table_args__ = (
        Index("ux_route_arrivals_replica_batch", "replica", "batch", "model", unique=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    replica: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    payload: Mapped[list[list[float]]] = mapped_column(JSON)
    batch: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
