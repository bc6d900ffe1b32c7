"""Evaluations: a job row of kind ``eval`` scores a fine-tuned adapter on a test file on a worker's
GPU (POST /v1/evaluations), queued, leased and reaped as training jobs are; ``outcome`` holds its
scores once it has succeeded.

Revision ID: 0008_evaluations
Revises: 0007_file_prompts
Create Date: 2026-12-08
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_evaluations"
down_revision = "0007_file_prompts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("kind", sa.String(16), nullable=False, server_default="fine_tune"))
        batch.add_column(sa.Column("outcome", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("outcome")
        batch.drop_column("kind")
