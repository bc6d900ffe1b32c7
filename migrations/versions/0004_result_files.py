"""A succeeded job's results file (OpenAI's ``result_files``: step_metrics.csv, purpose fine-tune-results).

Revision ID: 0004_result_files
Revises: 0003_checkpoint_adapters
Create Date: 2026-12-05
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_result_files"
down_revision = "0003_checkpoint_adapters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("result_file_id", sa.String(40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("result_file_id")
