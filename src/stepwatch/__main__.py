"""``python -m stepwatch`` is the ``stepwatch`` command."""

from .ui.cli import main

main()
