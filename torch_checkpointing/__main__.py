"""`python -m torch_checkpointing ...` and the `torch-checkpointing` command: the operations CLI (see
torch_checkpointing.cli)."""

import signal
import sys
import threading
from collections.abc import Callable

EXIT_INTERRUPTED = 128 + 2  # SIGINT, as shells report a command Ctrl-C stopped


def run() -> int:
    """The CLI, with a Ctrl-C during its start (importing torch takes seconds) ended as one inside it is: one
    line on stderr and exit code 130, no traceback."""
    try:
        main = _import_cli_holding_ctrl_c()
    except KeyboardInterrupt:
        print("torch-checkpointing: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return main()


def _import_cli_holding_ctrl_c() -> Callable[[], int]:
    """`cli.main`, with a Ctrl-C during the import held until it is done, then raised as KeyboardInterrupt.

    Importing torch runs seconds of C++ that a KeyboardInterrupt cannot cross: landing there, it was swallowed
    (the command went on as if no key was pressed), turned into `ImportError: cannot load module more than once
    per process` (torch had tried numpy and cleared the error) or aborted the process from C++.
    """
    held: list[int] = []
    # not when the shell ignores SIGINT (`cmd &`), a caller handles it, or signals cannot be set (another thread)
    hold = signal.getsignal(signal.SIGINT) is signal.default_int_handler and threading.current_thread() is (
        threading.main_thread()
    )
    if hold:
        signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        from torch_checkpointing.cli import main
    finally:
        if hold:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt
    return main


if __name__ == "__main__":
    sys.exit(run())
