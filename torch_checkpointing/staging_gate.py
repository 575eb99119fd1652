"""The writer process's side of a save whose slab is still being filled: write what is staged, wait for the rest.

An async save hands its request to the writer as soon as the staged tree is planned, while the trainer still
copies tensors into the slab in slab order and reports, over the progress pipe, the offset below which the
slab is filled (`checkpoint_process.py` carries the reports). The writer then encodes and writes each file as
far as the slab allows, instead of waiting for the whole copy: the first save, whose copy runs at the
speed of first-touch page faults, is written while it is copied.

Two ways to wait, and the reason there are two:

* `torch.save` hands each storage's own memory to the stream's `write()` (checked once per process by
  `torch_save_streams_storages`), so a Torch item's writes are gated one storage at a time, by the address
  of what is written: bytes that lie in the slab are written only once the slab is filled past them.
* Every other encoder may read tensors before it writes (safetensors serialises the whole item into one
  buffer first), so such an item waits until the slab is filled past the end of its last tensor.

Before the commit every rank waits for the whole slab (`wait_all`): a staging copy that failed at its very
end still fails the save. A failed copy is reported as such and fails the write at once; a trainer that is
gone (the pipe's end) fails it too; neither ever commits.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import IO, Any

import torch

from torch_checkpointing.checkpoint_layout import SerializationFormat, TorchSerialization
from torch_checkpointing.encoding import encode
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.staging import fits_slab
from torch_checkpointing.traversal import leaves

__all__ = ["STAGING_FAILED", "SlabGate", "StagingFailed", "StagingMarks", "torch_save_streams_storages"]

STAGING_FAILED = -1  # the offset a trainer reports when its staging copy failed


class StagingFailed(CheckpointError):
    """The trainer's staging copy of this save failed, or the trainer is gone: nothing may be committed."""


class StagingMarks:
    """How far the trainer has filled the slab, for the save it staged last (one save is in flight at a time)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seq = -1
        self._upto = 0
        self._gone = False

    def update(self, seq: int, upto: int) -> None:
        with self._cond:
            if seq > self._seq:
                self._seq, self._upto = seq, upto
            elif seq == self._seq and self._upto != STAGING_FAILED:
                self._upto = upto if upto == STAGING_FAILED else max(self._upto, upto)
            self._cond.notify_all()

    def trainer_gone(self) -> None:
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def wait(self, seq: int, end: int, timeout_s: float, what: str) -> None:
        """Return once save `seq`'s slab is filled up to byte `end`; raise if its copy failed or never gets there."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._seq == seq and self._upto == STAGING_FAILED:
                    raise StagingFailed(f"{what}: the trainer's staging copy failed; nothing was committed.")
                if self._seq == seq and self._upto >= end:
                    return
                if self._seq > seq or self._gone:
                    raise StagingFailed(
                        f"{what}: the trainer stopped reporting its staging copy (it is gone, or moved on to another "
                        f"save); nothing was committed."
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StagingFailed(
                        f"{what}: the trainer's staging copy did not reach byte {end} of the slab within "
                        f"{timeout_s:.0f}s (save.wait_timeout_secs); nothing was committed."
                    )
                self._cond.wait(min(remaining, 1.0))


class SlabGate:
    """One save's view of `StagingMarks`: where the slab lies in this process, and how to write an item early."""

    def __init__(self, marks: StagingMarks, seq: int, slab: torch.Tensor, timeout_s: float, what: str) -> None:
        self._marks, self._seq, self._timeout_s, self._what = marks, seq, timeout_s, what
        self._base = slab.data_ptr()
        self._nbytes = slab.numel() * slab.element_size()

    def wait_for(self, end: int) -> None:
        if end > 0:
            self._marks.wait(self._seq, end, self._timeout_s, self._what)

    def wait_all(self) -> None:
        self.wait_for(self._nbytes)

    def encode(self, fmt: SerializationFormat, key: str, value: Any, stream: IO[bytes]) -> None:
        """`encode`, reading no slab byte before the trainer has copied it."""
        if isinstance(fmt, TorchSerialization) and torch_save_streams_storages():
            gated = _GatedStream(stream, self)
            encode(fmt, key, value, gated)  # type: ignore[arg-type]
            self._check_streamed(key, value, gated.streamed)
        else:
            self.wait_for(self._end_of(value))
            encode(fmt, key, value, stream)

    def in_slab(self, address: int, nbytes: int) -> int:
        """The slab offset where `nbytes` at `address` end, or 0 if they are not slab memory."""
        if self._base <= address < self._base + self._nbytes:
            return address - self._base + nbytes
        return 0

    def _slab_tensors(self, value: Any) -> dict[int, int]:
        """data_ptr -> nbytes of each distinct tensor of `value` that views the slab."""
        found: dict[int, int] = {}
        for leaf in leaves(value):
            if isinstance(leaf, torch.Tensor) and fits_slab(leaf) and leaf.numel() and leaf.device.type == "cpu":
                nbytes = leaf.numel() * leaf.element_size()
                if self.in_slab(leaf.data_ptr(), nbytes):
                    found[leaf.data_ptr()] = nbytes
        return found

    def _end_of(self, value: Any) -> int:
        return max((self.in_slab(p, n) for p, n in self._slab_tensors(value).items()), default=0)

    def _check_streamed(self, key: str, value: Any, streamed: int) -> None:
        """Every staged byte of the item must have gone through the gated stream: bytes torch read some other
        way may predate the copy, and such a file is never committed."""
        expected = sum(self._slab_tensors(value).values())
        if streamed != expected:
            raise CheckpointError(
                f"{self._what}: item '{key}': torch.save wrote {streamed} of the {expected} staged bytes from "
                f"the staging slab itself, so the file may hold bytes from before the staging copy; it is not "
                f"committed. This torch version serialises differently from what the writer checks for at start; "
                f"please report it (CheckpointStagerConfig(use_async_staging=False) does not avoid it)."
            )


class _GatedStream:
    """Forwards writes; one that lies in the slab waits until the trainer has copied past its end."""

    def __init__(self, inner: Any, gate: SlabGate) -> None:
        self._inner, self._gate = inner, gate
        self.streamed = 0  # slab bytes written through here

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.nbytes:
            end = self._gate.in_slab(_address(view), view.nbytes)
            if end:
                self._gate.wait_for(end)
                self.streamed += view.nbytes
        return self._inner.write(data)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _address(view: memoryview) -> int:
    """Where a buffer's bytes start in this process's memory (read-only buffers included)."""
    import numpy  # torch's own `.numpy()` needs it; the writer already uses it to map the slab

    flat = view if view.ndim == 1 and view.format == "B" else view.cast("B")
    return int(numpy.frombuffer(flat, numpy.uint8).ctypes.data)


@functools.cache
def torch_save_streams_storages() -> bool:
    """Whether this torch's `torch.save` writes each storage from the storage's own memory straight to the
    stream (one `write()` per record, no copy) and reads it for nothing else first (no per-record CRC32).

    Checked on a probe tensor, once per process: where it does not hold, Torch items wait for their whole
    range of the slab like every other format.
    """
    try:
        import torch.utils.serialization

        if torch.utils.serialization.config.save.compute_crc32:
            return False
    except (ImportError, AttributeError):
        return False
    probe = torch.arange(2048, dtype=torch.int64)
    writes: list[tuple[int, int]] = []

    class _Probe:
        def write(self, data: Any) -> int:
            view = memoryview(data)
            if view.nbytes:
                writes.append((_address(view), view.nbytes))
            return view.nbytes

        def flush(self) -> None:
            return None

    try:
        torch.save({"probe": probe}, _Probe())  # type: ignore[arg-type]
    except Exception:
        return False
    nbytes = probe.numel() * probe.element_size()
    return (probe.data_ptr(), nbytes) in writes
