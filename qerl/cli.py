"""The `qerl` command: each area registers its own sub-commands."""
from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="qerl: RL fine-tuning on one GPU")

# (module, what it adds); a module that cannot be imported leaves its commands out with a note.
_COMMANDS = (
    ("qerl.cli_service", "serve, keys, migrate, queue"),
    ("worker.cli", "worker"),
    ("qerl.cli_engine", "train, quantize"),
    ("qerl.cli_plan", "plan"),
    ("qerl.cli_generate", "generate"),
    ("qerl.cli_eval", "eval"),
    ("qerl.cli_evaluations", "evaluations"),
    ("qerl.cli_client", "files, jobs, adapters"),
    ("qerl.cli_graders", "graders"),
    ("qerl.demo", "demo"),
)

for _module, _what in _COMMANDS:
    importlib.import_module(_module).register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
