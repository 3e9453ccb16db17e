"""Entry point of ``python -m flash_qla.bench`` (the command line lives in :mod:`flash_qla.bench.cli`)."""
import sys

from .cli import main

sys.exit(main())
