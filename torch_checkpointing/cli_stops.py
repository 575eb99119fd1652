"""How the operations CLI reports a command a signal stopped: its words, the `kind` of its `--json` error
document, its exit code; and whether the command line asked for that document.

One place for both ends of the CLI: `cli.main` once a command runs, and `__main__`, which reports a signal
that landed while `cli` (and with it torch) was still being imported. This module imports neither torch nor
`cli`, so `__main__` can import it before it holds the signals.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["STOPS", "Stop", "json_requested"]


@dataclass(frozen=True)
class Stop:
    """A signal's stop: `said` on stderr, `kind` in the `--json` document, `code` as shells report it."""

    said: str
    kind: str
    code: int


STOPS = {
    signal.SIGINT: Stop("interrupted", "KeyboardInterrupt", 128 + signal.SIGINT),  # Ctrl-C
    signal.SIGTERM: Stop("terminated (SIGTERM)", "Terminated", 128 + signal.SIGTERM),  # `timeout`, `kill`
}


def json_requested(argv: Sequence[str]) -> bool:
    """Whether `--json` is among the options (before a `--`, after which it would be a path), spelt as argparse
    takes it: `--js` and `--jso` too, a prefix of no other option of the CLI. Looking for `--json` alone, a
    script that wrote `--jso` got its report as JSON, but an empty stdout for a usage error."""
    argv = list(argv)
    return any(len(arg) > 2 and "--json".startswith(arg) for arg in argv[: argv.index("--") if "--" in argv else None])
