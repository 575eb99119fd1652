"""How a call on one rank of a multi-rank test ended, as a line its result dict carries back to the test.

A rank's function returns a dict (`simulator.launcher.launch` pickles it to the test); an exception raised on a
rank would end that rank instead, so the multi-rank tests record each save's ending and assert on every rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch_checkpointing.errors import CommitError


def record_outcome(out: dict[str, Any], key: str, call: Callable[[], object], returned: str = "no error") -> None:
    """Run `call` and set `out[key]`: `returned` when it returns, "CommitError: <message>" (and `out["failures"]`,
    the failing ranks in order) when the ranks refused it together, "<type>: <message>" for anything else."""
    try:
        call()
        out[key] = returned
    except CommitError as exc:
        out[key] = f"CommitError: {exc}"
        out["failures"] = sorted(exc.failures)
    except BaseException as exc:
        out[key] = f"{type(exc).__name__}: {exc}"
