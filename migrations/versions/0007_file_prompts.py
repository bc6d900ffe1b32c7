"""How many distinct questions an uploaded file holds, so that a job's held-out split is sized
from them (a file that repeats its prompts) and one that would hold out all of them is refused
when it is created.

Revision ID: 0007_file_prompts
Revises: 0006_file_fields
Create Date: 2026-12-07
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_file_prompts"
down_revision = "0006_file_fields"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("prompts", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.drop_column("prompts")
