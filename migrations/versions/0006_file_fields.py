"""An uploaded file's top-level fields and how many rows have each, so that a job whose grader
reads a field some rows lack is refused when it is created.

Revision ID: 0006_file_fields
Revises: 0005_job_samples
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_file_fields"
down_revision = "0005_job_samples"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("fields", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("fields")
