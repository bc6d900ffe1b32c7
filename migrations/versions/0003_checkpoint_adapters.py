"""Checkpoints whose LoRA is kept in the artifact store (qerl.keep_checkpoint_adapters).

Revision ID: 0003_checkpoint_adapters
Revises: 0002_webhook_events
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_checkpoint_adapters"
down_revision = "0002_webhook_events"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("adapter_path", sa.Text(), nullable=True))
        batch.add_column(sa.Column("adapter_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("adapter_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("adapter_sha256")
        batch.drop_column("adapter_bytes")
        batch.drop_column("adapter_path")
