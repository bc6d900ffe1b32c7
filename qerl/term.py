"""The CLI's standard output: rich's console, held to the terminal's width on a terminal, and not
cut or wrapped at rich's default of 80 columns in a log or a pipe (no terminal, no COLUMNS), so ids,
paths, tables and step lines stay whole for grep and scripts."""
from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.rule import Rule

PIPED_WIDTH = 400


def stdout_console() -> Console:
    # emoji off: names like ft:base:proj:fire:id hold emoji codes
    return Console(emoji=False, width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else PIPED_WIDTH)


def rule(console: Console, title: str) -> None:
    """A titled line across the terminal; in a log or a pipe, 80 columns of it (not PIPED_WIDTH)."""
    console.print(Rule(title), width=None if console.is_terminal else 80)
