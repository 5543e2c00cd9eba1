"""``python -m retool``: the same CLI as the ``retool`` console script."""

from retool.cli import main

main()
