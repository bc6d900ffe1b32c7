"""``python -m qerl``: the ``qerl`` command, for an environment whose scripts are not on PATH."""
from qerl.cli import main

main()
