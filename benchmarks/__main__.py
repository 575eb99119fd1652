"""Entry point of ``python -m benchmarks``; see benchmarks/cli.py for the options."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
