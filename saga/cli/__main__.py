"""``python -m saga.cli``: the ``saga`` command where its script is not on the PATH."""

from saga.cli.main import main

main()
