"""A storage that tells the fault injector "I am writing now, in process P" and then holds the write.

The faults scenario kills a rank, or a writer process, *mid-save*. Timing guesses ("sleep 2 s, then kill")
would kill too early or too late depending on the machine's load, so instead the process that performs the
write announces itself: on its first write of a file whose name contains ``trigger`` (a data file, not the
engine's bookkeeping), it writes its pid into ``signal_path`` (atomically, via a rename) and sleeps
``hold_s`` before writing. The injector waits for that file and kills exactly that pid, so the kill always
lands while the save is in flight, on every run.

The config is a plain module-level dataclass subclassing the public ``StorageConfig`` (through
:mod:`simulator.storage`), so an async engine can pickle it into its spawned writer process, which re-imports
this module; the announcing pid is then the writer's, not the trainer's.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.storage import InstrumentedStorage, InstrumentedStorageConfig


@dataclass
class SignallingStorageConfig(InstrumentedStorageConfig):
    """Buffered local storage; with ``signal_path`` set, the first matching write announces its pid and holds."""

    signal_path: str = ""
    trigger: str = ""
    hold_s: float = 0.0

    def create_storage(self) -> SignallingStorage:
        return SignallingStorage(self)


class SignallingStorage(InstrumentedStorage):
    """Writes like :class:`InstrumentedStorage`; announces (once) the process performing a matching write."""

    def __init__(self, config: SignallingStorageConfig) -> None:
        super().__init__(config)
        self._signal_path = config.signal_path
        self._trigger = config.trigger
        self._hold_s = config.hold_s

    def _announce(self, path: Path) -> None:
        """Publish this process's pid for the injector, then hold the write so the kill lands mid-save."""
        if not self._signal_path or self._trigger not in Path(path).name or os.path.exists(self._signal_path):
            return
        tmp = f"{self._signal_path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} {time.time():.6f} {path}\n")
        os.replace(tmp, self._signal_path)  # the injector never sees a half-written pid
        time.sleep(self._hold_s)

    def stream_write(self, path: Path) -> io.IOBase:
        self._announce(path)
        return super().stream_write(path)

    def write(self, path: Path, data: Any) -> None:
        self._announce(path)
        super().write(path, data)


def read_signal(signal_path: str) -> tuple[int, float, str] | None:
    """(pid, unix time, path being written) once the signal file exists, else None."""
    try:
        text = Path(signal_path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    pid, when, path = text.split(" ", 2)
    return int(pid), float(when), path


def wait_for_signal(signal_path: str, timeout_s: float, alive: Any = None) -> tuple[int, float, str] | None:
    """Poll for the signal file, bounded by ``timeout_s``; ``alive()`` returning False stops the wait early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = read_signal(signal_path)
        if got is not None:
            return got
        if alive is not None and not alive():
            return read_signal(signal_path)
        time.sleep(0.05)
    return None
