"""`python -m torch_checkpointing ...` and the `torch-checkpointing` command: the operations CLI (see
torch_checkpointing.cli)."""

import atexit
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable

from torch_checkpointing.cli_stops import STOPS, json_requested


def run() -> int:
    """The CLI, with a Ctrl-C or SIGTERM during its start (importing torch takes seconds) ended as one inside it
    is: one line on stderr and exit code 128 + the signal (130, 143), no traceback."""
    held: list[int] = []
    main = _import_cli_holding(held)
    if held:
        stop = STOPS[signal.Signals(held[0])]
        said = f"torch-checkpointing: {stop.said}"
        if json_requested(sys.argv[1:]):  # the document scripts parse, as cli's
            print(json.dumps({"error": said, "kind": stop.kind}, indent=2, sort_keys=True))
        print(said, file=sys.stderr)
        return stop.code
    code = main()
    _exit_on_a_late_stop(code)
    return code


def _exit_on_a_late_stop(code: int) -> None:
    """From here on, a Ctrl-C or SIGTERM ends the process at once with the command's own exit `code`.

    The command has finished and written its whole report; the interpreter's exit after it (torch's teardown,
    about half a second) is no part of it. A SIGTERM landing there killed the process by its default action:
    exit 143 with no line on stderr for a command that had done its work and said so (a prune's reported
    deletions, a complete export), which a script reads as a command stopped midway. Not for a signal the
    shell ignores or a caller handles, nor off the main thread (as `_import_cli_holding`).
    """
    if threading.current_thread() is not threading.main_thread():
        return

    def finish(_signum: int, _frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: its loss was reported when lost
                stream.flush()
        os._exit(code)

    taken = [signum for signum in STOPS if signal.getsignal(signum) in (signal.default_int_handler, signal.SIG_DFL)]
    for signum in taken:
        signal.signal(signum, finish)
    atexit.register(_ignore, taken)


def _ignore(signums: list[signal.Signals]) -> None:
    """Ignore `signums` for the rest of the interpreter's exit. Its finalization puts every Python handler back
    to the default action (an ignored signal it leaves ignored), and torch's teardown comes after it: a SIGTERM
    there still killed the process (exit 143, no line) for all `finish` was set. Run at exit, where no Python
    code of the command is left; the process ends with its exit code on its own."""
    for signum in signums:
        signal.signal(signum, signal.SIG_IGN)


def _import_cli_holding(held: list[int]) -> Callable[[], int]:
    """`cli.main`, with a Ctrl-C or SIGTERM during the import held (appended to `held`) until it is done.

    Importing torch runs seconds of C++ that a KeyboardInterrupt cannot cross: landing there, it was swallowed
    (the command went on as if no key was pressed), turned into `ImportError: cannot load module more than once
    per process` (torch had tried numpy and cleared the error) or aborted the process from C++.

    simulator.cli keeps its own copy (`_import_holding_signals`): it may use only the engine's public API.
    """
    # not for a signal the shell ignores (`cmd &`) or a caller handles, nor on another thread (cannot set one)
    holding = [
        signum
        for signum in STOPS
        if signal.getsignal(signum) in (signal.default_int_handler, signal.SIG_DFL)
        and threading.current_thread() is threading.main_thread()
    ]
    previous = {signum: signal.signal(signum, lambda signum, _frame: held.append(signum)) for signum in holding}
    try:
        from torch_checkpointing.cli import main
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return main


if __name__ == "__main__":
    sys.exit(run())
