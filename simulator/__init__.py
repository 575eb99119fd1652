"""Multi-rank simulator: launches real gloo ranks on one machine and runs
checkpointing scenarios against a backend through its public API.

The launcher lives in :mod:`simulator.launcher`; importing this package alone
stays cheap (no torch import) so `python -m simulator --help` is instant.
"""

from typing import Any

__all__ = ["LaunchError", "launch", "report_progress"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from simulator import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'simulator' has no attribute {name!r}")
