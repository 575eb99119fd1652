"""`python -m simulator --world 4→8`."""

from simulator.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
