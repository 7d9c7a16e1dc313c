"""The ``saga`` command (``saga --help``): runs, show, escalations, escalation show, requeue,
resolve, reap and doctor, with rich output, ``--json`` for scripts and exit codes that mean
something (``ExitCode``)."""

from saga.cli.context import ExitCode
from saga.cli.main import cli, main

__all__ = ["ExitCode", "cli", "main"]
