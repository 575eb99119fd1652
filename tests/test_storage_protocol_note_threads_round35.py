"""Two threads checking one `FsspecStorageConfig` again (two managers built from it at once) keep its note.

`__post_init__` reads the note "protocol taken" (the protocol it filled in from the url), fills the protocol in
again, and writes the note, without the notes' lock that `config.warn_once` holds for its own read, change and
write. A thread that read the config between another's fill-in and its note took the filled-in protocol for
one the user gave, and its note (None) was written last: the url edited afterwards to another store was refused
as naming another protocol than the one "given".

Real threads running the real check; a trace function stops each at a chosen line of the check.
"""

from __future__ import annotations

import inspect
import sys
import threading
from types import FrameType
from typing import Any

from torch_checkpointing import FsspecStorageConfig
from torch_checkpointing.config import recheck

_SOURCE = inspect.getsourcefile(FsspecStorageConfig)


def _line_of(text: str) -> int:
    """The line of the config's check (its module) whose code is `text` (the only one)."""
    lines, _ = inspect.findsource(FsspecStorageConfig)
    (found,) = [i + 1 for i, line in enumerate(lines) if line.strip() == text]
    return found


def _rechecked_stopping_at(
    config: FsspecStorageConfig, line: int, stopped: threading.Event, go: threading.Event
) -> threading.Thread:
    """A thread running `recheck(config)`, which sets `stopped` and waits for `go` when it reaches `line` (once)."""

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename != _SOURCE:
            return None
        if event == "line" and frame.f_lineno == line and not stopped.is_set():
            stopped.set()
            go.wait(60)  # only to stop a hang
        return trace

    def run() -> None:
        sys.settrace(trace)
        try:
            recheck(config)
        finally:
            sys.settrace(None)

    return threading.Thread(target=run)


def test_a_check_run_in_two_threads_at_once_keeps_the_protocol_it_filled_in() -> None:
    """Defect: ConfigError "... memory:// ... file://" on the last edit: the note said the protocol was given."""
    config = FsspecStorageConfig(url="memory://first/run")
    config.url = "file:///data/ckpt/run"  # edited: the next check fills "file" in
    a_stopped, a_go, b_stopped, b_go = (threading.Event() for _ in range(4))
    # a: stopped once it filled "file" in, before its note; b: stopped after it read the config
    a = _rechecked_stopping_at(config, _line_of("self._check_url_protocol()"), a_stopped, a_go)
    b = _rechecked_stopping_at(config, _line_of("taken = not self.protocol"), b_stopped, b_go)
    a.start()
    assert a_stopped.wait(60)
    b.start()
    b_stopped.wait(5)  # a thread that waits for a's check to end does not stop here until a is done
    a_go.set()
    a.join(60)
    b_go.set()
    b.join(60)
    assert config.protocol == "file"
    config.url = "memory://second/run"  # edited again: the protocol follows it, as it did after the first edit
    recheck(config)
    assert config.protocol == "memory"
