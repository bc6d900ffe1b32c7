"""Initial schema: api keys, files, jobs, events, metrics, checkpoints, adapters.

Revision ID: 0001_initial
Revises:
Create Date: 2025-11-30
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None

BigIntId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _ts(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        _ts("created_at"),
        _ts("revoked_at", nullable=True),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_project", "api_keys", ["project"])

    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        _ts("created_at"),
        _ts("deleted_at", nullable=True),
    )
    op.create_index("ix_files_project", "files", ["project"])

    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("status", sa.String(24), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("training_file", sa.String(40), sa.ForeignKey("files.id"), nullable=True),
        sa.Column("validation_file", sa.String(40), sa.ForeignKey("files.id"), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("suffix", sa.String(64), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_hash", sa.String(64), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        _ts("lease_expires_at", nullable=True),
        _ts("heartbeat_at", nullable=True),
        _ts("wakeup_sent_at", nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("trained_tokens", sa.BigInteger(), nullable=False),
        sa.Column("resume_checkpoint_id", sa.String(40), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("error_param", sa.String(255), nullable=True),
        sa.Column("fine_tuned_model", sa.String(255), nullable=True),
        sa.Column("adapter_id", sa.String(40), nullable=True),
        _ts("created_at"),
        _ts("started_at", nullable=True),
        _ts("finished_at", nullable=True),
        sa.UniqueConstraint("project", "idempotency_key", name="uq_jobs_project_idempotency_key"),
    )
    op.create_index("ix_jobs_project", "jobs", ["project"])
    op.create_index("ix_jobs_status_created", "jobs", ["status", "created_at"])

    op.create_table(
        "job_events",
        sa.Column("id", BigIntId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("level", sa.String(8), nullable=False),
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        _ts("created_at"),
    )
    op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"])

    op.create_table(
        "job_metrics",
        sa.Column("id", BigIntId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("values", sa.JSON(), nullable=False),
        _ts("created_at"),
        sa.UniqueConstraint("job_id", "step", "attempt", name="uq_job_metrics_job_step_attempt"),
    )
    op.create_index("ix_job_metrics_job_id", "job_metrics", ["job_id"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        _ts("created_at"),
    )
    op.create_index("ix_checkpoints_job_step", "checkpoints", ["job_id", "step"])

    op.create_table(
        "adapters",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("project", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("base_model", sa.String(255), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        _ts("created_at"),
        sa.UniqueConstraint("job_id", name="uq_adapters_job_id"),
    )
    op.create_index("ix_adapters_project", "adapters", ["project"])


def downgrade() -> None:
    for index, table in [("ix_adapters_project", "adapters"), ("ix_checkpoints_job_step", "checkpoints"),
                         ("ix_job_metrics_job_id", "job_metrics"), ("ix_job_events_job_id_id", "job_events"),
                         ("ix_jobs_status_created", "jobs"), ("ix_jobs_project", "jobs"),
                         ("ix_files_project", "files"), ("ix_api_keys_project", "api_keys")]:
        op.drop_index(index, table_name=table)
    for table in ["adapters", "checkpoints", "job_metrics", "job_events", "jobs", "files", "api_keys"]:
        op.drop_table(table)
