"""`python -m simulator --world 4→8`."""

from simulator.cli import run

if __name__ == "__main__":
    raise SystemExit(run())
