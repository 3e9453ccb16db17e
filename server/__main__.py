"""``python -m server``: see :mod:`server.cli`."""
from .cli import main

main()
