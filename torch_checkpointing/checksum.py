"""The one CRC32 implementation: whole-file checksums and per-block checksums, computed once by every writer.

A file's manifest record holds its CRC32 (the field every manifest has had) and, since block checksums were
added, the CRC32 of each fixed-size block of it. A load that reads only some byte ranges of a file (a
resharding load) verifies exactly the blocks those ranges touch instead of reading the whole file; a load that
reads a file whole verifies every block. Writers checksum each block once and derive the whole-file CRC32 by
combining the block CRCs, so no byte is checksummed twice.

ISA-L (`pip install torch-checkpointing[fast]`) computes the same CRC32 as zlib about four times faster; zlib is
the fallback, with a small `crc32_combine` of our own (zlib's is not exposed to Python).
"""

from __future__ import annotations

import binascii
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from torch_checkpointing.errors import CorruptCheckpointError, unknown_to_this_engine
from torch_checkpointing.futures import settle_all

__all__ = [
    "BLOCK_SIZE",
    "BlockChecksums",
    "FileChecksum",
    "RunningChecksum",
    "block_crc32s",
    "crc32",
    "crc32_combine",
    "crc32_parallel",
]

# 256 KiB: a ranged read fetches at most one block more on each side than it needs (the resharding benchmark's
# ranges are ~1-10 MiB), and the manifest grows by 8 hex characters per block: 32 KiB per GiB of data.
BLOCK_SIZE = 256 * 1024
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 1 << 30

try:  # ISA-L: the same CRC32 as zlib, faster; its combine is in C too.
    from isal import isal_zlib as _isal

    _crc32: Callable[[Any, int], int] = _isal.crc32
    _native_combine: Callable[[int, int, int], int] | None = _isal.crc32_combine
except ImportError:  # pragma: no cover - depends on the optional extra
    import zlib

    _crc32 = zlib.crc32
    _native_combine = None

_POLY = 0xEDB88320  # CRC-32 (IEEE), reflected: the polynomial of zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """CRC32 of a buffer, continuing from `value` (zlib's convention)."""
    return _crc32(data, value) & 0xFFFFFFFF


# ------------------------------------------------------------------------------------------------ combining


def _apply(matrix: Sequence[int], vec: int) -> int:
    """Multiply a 32x32 GF(2) matrix (one int per column) by a 32-bit vector."""
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= matrix[i]
        vec >>= 1
        i += 1
    return out


def _square(matrix: Sequence[int]) -> tuple[int, ...]:
    return tuple(_apply(matrix, matrix[i]) for i in range(32))


@functools.lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) matrix that advances a CRC32 register over `nbytes` zero bytes (cached: block sizes repeat)."""
    one_bit = (_POLY, *(1 << i for i in range(31)))  # the register shifted by one zero bit
    power = _square(_square(_square(one_bit)))  # 8 bits: one zero byte
    result: tuple[int, ...] | None = None
    n = nbytes
    while n:
        if n & 1:
            result = power if result is None else tuple(_apply(power, c) for c in result)
        n >>= 1
        if n:
            power = _square(power)
    return result if result is not None else tuple(1 << i for i in range(32))


def _python_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine: the CRC32 of A+B from crc(A), crc(B) and len(B)."""
    if len2 <= 0:
        return crc1
    return (_apply(_shift_operator(len2), crc1) ^ crc2) & 0xFFFFFFFF


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of the concatenation A+B, given crc32(A), crc32(B) and len(B)."""
    if _native_combine is not None:
        return _native_combine(crc1, crc2, len2) & 0xFFFFFFFF
    return _python_combine(crc1, crc2, len2)


PARALLEL_PIECE_BYTES = 64 * 1024 * 1024


def crc32_parallel(view: memoryview, executor: Executor, workers: int) -> int:
    """CRC32 of a large byte buffer, computed in up to `workers` pieces on `executor` and combined.

    Both native CRCs release the GIL, so the pieces run on as many cores: a load verifies its largest file
    before its first copy, and one core's pass over a GiB (50-80 ms) was the load's critical path. Buffers
    under two pieces of PARALLEL_PIECE_BYTES are checksummed in one call: splitting them costs more than it saves.
    """
    n = len(view)
    parts = min(workers, n // PARALLEL_PIECE_BYTES)
    if parts < 2:
        return crc32(view)
    step = -(-n // parts)
    bounds = [(s, min(n, s + step)) for s in range(0, n, step)]
    pieces = [view[s:e] for s, e in bounds]
    futures = [executor.submit(crc32, piece) for piece in pieces]
    try:
        crcs = [f.result() for f in futures]
    finally:
        settle_all(futures)  # released only once no thread reads them: the caller may unmap the buffer next
        for piece in pieces:
            piece.release()
    value = 0
    for piece_crc, (s, e) in zip(crcs, bounds, strict=True):
        value = crc32_combine(value, piece_crc, e - s)
    return value


def block_crc32s(view: memoryview, block_size: int) -> list[int]:
    """The CRC32 of each `block_size` block of `view` (the last may be short)."""
    return [crc32(view[s : s + block_size]) for s in range(0, len(view), block_size)]


def combine_blocks(crcs: Sequence[int], size: int, block_size: int) -> int:
    """The whole-file CRC32 of a file of `size` bytes from its block CRCs."""
    value = 0
    for i, c in enumerate(crcs):
        value = crc32_combine(value, c, min(block_size, size - i * block_size))
    return value


# ------------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class BlockChecksums:
    """The CRC32 of every `block_size` block of one file, in file order (the last block may be short)."""

    block_size: int
    crc32s: tuple[int, ...]

    def block_count(self) -> int:
        return len(self.crc32s)

    def span(self, index: int, size: int) -> tuple[int, int]:
        """Byte range [start, end) of block `index` of a file of `size` bytes."""
        start = index * self.block_size
        return start, min(start + self.block_size, size)

    def to_json(self) -> dict[str, Any]:
        """Compact form for the manifest: 8 hex digits per block."""
        return {"block_size": self.block_size, "crc32": b"".join(c.to_bytes(4, "big") for c in self.crc32s).hex()}

    @classmethod
    def from_json(cls, value: Any, size: int, where: str) -> BlockChecksums:
        """Parse the manifest form strictly: the block count must fit the file's size. A field beside the two this
        engine writes is a newer engine's (`unknown_to_this_engine`): what it changes is unknown here, and it is
        no damage."""
        extra = sorted(set(value) - {"block_size", "crc32"}) if isinstance(value, dict) else []
        if extra and {"block_size", "crc32"} <= set(value) and all(k.isidentifier() for k in extra):
            raise unknown_to_this_engine(where, "beside field 'blocks.crc32' the field", extra[0])
        if not isinstance(value, dict) or set(value) != {"block_size", "crc32"}:
            raise CorruptCheckpointError(
                f"{where}: field 'blocks' must be an object with exactly 'block_size' and 'crc32'."
            )
        block_size, text = value["block_size"], value["crc32"]
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise CorruptCheckpointError(f"{where}: field 'blocks.block_size' has the wrong type.")
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise CorruptCheckpointError(
                f"{where}: field 'blocks.block_size' is {block_size}, outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]."
            )
        if not isinstance(text, str):
            raise CorruptCheckpointError(f"{where}: field 'blocks.crc32' has the wrong type (a hex string).")
        want = -(-size // block_size)
        if len(text) != 8 * want:
            raise CorruptCheckpointError(
                f"{where}: field 'blocks.crc32' holds {len(text) / 8:g} block checksums, but a file of {size} bytes "
                f"has {want} blocks of {block_size}."
            )
        try:
            raw = binascii.unhexlify(text)
        except (binascii.Error, ValueError):
            raise CorruptCheckpointError(f"{where}: field 'blocks.crc32' is not a hex string.") from None
        crcs = tuple(int.from_bytes(raw[i : i + 4], "big") for i in range(0, len(raw), 4))
        return cls(block_size, crcs)


@dataclass(frozen=True)
class FileChecksum:
    """What a writer records for one file: its size, its whole CRC32 and its block CRC32s."""

    size: int
    crc32: int
    blocks: BlockChecksums


@dataclass
class RunningChecksum:
    """The checksum of a stream written in order: feed `update()` every byte, then read `result()`.

    Each block is checksummed once; the whole-file CRC32 is the combination of the block CRCs. Writers that
    checksum aligned runs of blocks elsewhere (an upload thread per part) hand them in with `add_blocks()`.
    """

    block_size: int = BLOCK_SIZE
    size: int = 0
    _crcs: list[int] = field(default_factory=list)
    _whole: int = 0
    _partial: int = 0  # CRC of the bytes of the block still being filled
    _fill: int = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        pos = 0
        if self._fill:
            pos = min(self.block_size - self._fill, n)
            self._partial = crc32(view[:pos], self._partial)
            self._fill += pos
            if self._fill == self.block_size:
                self._close_block(self._partial, self.block_size)
        while n - pos >= self.block_size:
            self._close_block(crc32(view[pos : pos + self.block_size]), self.block_size)
            pos += self.block_size
        if pos < n:
            self._partial = crc32(view[pos:])
            self._fill = n - pos
        self.size += n

    def add_blocks(self, crcs: Sequence[int], nbytes: int) -> None:
        """Blocks checksummed elsewhere: `nbytes` bytes starting on a block boundary, all blocks full but the
        last (which must then end the file)."""
        if self._fill:
            raise ValueError("add_blocks() needs the stream to be at a block boundary")
        for i, c in enumerate(crcs):
            length = min(self.block_size, nbytes - i * self.block_size)
            if length == self.block_size:
                self._close_block(c, length)
            else:
                self._partial, self._fill = c, length
        self.size += nbytes

    def _close_block(self, value: int, length: int) -> None:
        self._crcs.append(value)
        self._whole = crc32_combine(self._whole, value, length)
        self._partial = self._fill = 0

    @property
    def crc32(self) -> int:
        """The whole CRC32 of what was written so far."""
        return crc32_combine(self._whole, self._partial, self._fill) if self._fill else self._whole

    def result(self) -> FileChecksum:
        crcs = [*self._crcs, self._partial] if self._fill else list(self._crcs)
        return FileChecksum(self.size, self.crc32, BlockChecksums(self.block_size, tuple(crcs)))
