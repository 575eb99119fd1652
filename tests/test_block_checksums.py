"""Per-block checksums (issue 10 point 5, issue 14 point 3): writers record the CRC32 of every block, and a load
that reads byte ranges of a file (a resharding load) checks exactly the blocks those ranges touch.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import AlwaysReshard, _manager
from torch_checkpointing import ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, RawSerialization, SafetensorsSerialization
from torch_checkpointing.checksum import (
    BLOCK_SIZE,
    BlockChecksums,
    RunningChecksum,
    _python_combine,
    block_crc32s,
    combine_blocks,
    crc32_combine,
    crc32_parallel,
)
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.manifest import parse_manifest
from torch_checkpointing.read_context import CheckpointReadContext, ReadPolicy
from torch_checkpointing.storage.base_storage import Storage
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

N = 512 * 1024  # float32 elements: 2 MiB per tensor, eight blocks

# ---------------------------------------------------------------------------------- the checksum itself


@pytest.mark.parametrize("len2", [0, 1, 3, 255, 4096, BLOCK_SIZE, BLOCK_SIZE + 13, 3 * BLOCK_SIZE - 1])
def test_crc32_combine_equals_zlib_crc32_of_the_concatenation(len2: int) -> None:
    rng = random.Random(len2)
    a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(len2)
    want = zlib.crc32(a + b)
    assert _python_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want  # the zlib fallback's own combine
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want  # whichever library is installed


@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [0, 1, 1999, 2000, 2001, 7 * 1000 + 3])
def test_crc32_parallel_equals_one_pass(size: int, workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_checkpointing import checksum

    monkeypatch.setattr(checksum, "PARALLEL_PIECE_BYTES", 1000)  # pieces of this test's small buffers
    data = random.Random(size).randbytes(size)
    with ThreadPoolExecutor(4) as pool:
        view = memoryview(data)
        assert crc32_parallel(view, pool, workers) == zlib.crc32(data)
        view.release()  # every piece was released: the buffer (an mmap, in a load) can be closed


def test_a_whole_file_checked_in_pieces_finds_damage_in_each_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large file's CRC32 is computed in pieces on several cores; damage in any piece still fails the load."""
    from torch_checkpointing import checksum, read_context

    monkeypatch.setattr(checksum, "PARALLEL_PIECE_BYTES", 64 * 1024)
    monkeypatch.setattr(read_context, "_CHUNK_WORKERS", 4)
    threads: set[str] = set()
    one_pass = checksum.crc32

    def spy(data: Any, value: int = 0) -> int:
        threads.add(threading.current_thread().name)
        return one_pass(data, value)

    monkeypatch.setattr(checksum, "crc32", spy)
    root = tmp_path / "ck"
    values = torch.arange(N, dtype=torch.float32)
    _save(root, {"a": values}, reshard=False)
    data = (root / "model_0.pt").read_bytes()
    assert len(data) >= 4 * 64 * 1024  # four pieces
    start = _offset_of(root / "model_0.pt", values)
    for at in (start, start + 4 * N // 2, start + 4 * N - 1):
        (root / "model_0.pt").write_bytes(data)
        _flip(root / "model_0.pt", at)
        with pytest.raises(CorruptCheckpointError, match=r"model_0.pt.*fails its CRC32 check"):
            _load_whole(root)
    (root / "model_0.pt").write_bytes(data)
    assert torch.equal(_load_whole(root)["model"]["a"], values)
    assert any(name.startswith("ckpt-verify-crc") for name in threads)  # the pieces ran on the chunk pool


def _load_whole(root: Path) -> dict[str, Any]:
    m = _manager({"model": ItemSpec()})
    try:
        out: dict[str, Any] = m.load(str(root), into={"model": {"a": torch.zeros(N)}})
        return out
    finally:
        m.close()


@pytest.mark.parametrize("size", [0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, 5 * BLOCK_SIZE + 77])
def test_running_checksum_records_blocks_that_combine_to_the_whole_crc(size: int) -> None:
    rng = random.Random(size)
    data = rng.randbytes(size)
    running = RunningChecksum()
    pos = 0
    while pos < size:  # writes of every size, across block boundaries
        step = rng.choice([1, 7, 4096, BLOCK_SIZE // 3, BLOCK_SIZE + 5])
        running.update(data[pos : pos + step])
        pos += step
    summed = running.result()
    assert summed.size == size and summed.crc32 == zlib.crc32(data)
    assert summed.blocks.block_size == BLOCK_SIZE
    assert list(summed.blocks.crc32s) == [zlib.crc32(data[i : i + BLOCK_SIZE]) for i in range(0, size, BLOCK_SIZE)]
    assert block_crc32s(memoryview(data), BLOCK_SIZE) == list(summed.blocks.crc32s)
    assert combine_blocks(summed.blocks.crc32s, size, BLOCK_SIZE) == zlib.crc32(data)


def test_blocks_added_whole_equal_blocks_streamed() -> None:
    data = os.urandom(3 * BLOCK_SIZE + 100)
    streamed, added = RunningChecksum(), RunningChecksum()
    streamed.update(data)
    added.add_blocks(block_crc32s(memoryview(data[: 2 * BLOCK_SIZE]), BLOCK_SIZE), 2 * BLOCK_SIZE)
    added.add_blocks(block_crc32s(memoryview(data[2 * BLOCK_SIZE :]), BLOCK_SIZE), len(data) - 2 * BLOCK_SIZE)
    assert added.result() == streamed.result()


# ---------------------------------------------------------------------------------- writers and the manifest


def _save(root: Path, value: Any, layout: LayoutInfo | None = None, reshard: bool = True, **config: Any) -> None:
    spec = ItemSpec(resharder=AlwaysReshard() if reshard else None, layout=layout)
    m = _manager({"model": spec}, **config)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.save(str(root), {"model": value})
    finally:
        m.close()


def _record(root: Path) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads((root / "manifest.json").read_text())["items"]["model"]["0"]
    return rec


@pytest.mark.parametrize("direct_io", [True, False])
def test_the_local_writer_records_block_crcs_of_what_it_wrote(tmp_path: Path, direct_io: bool) -> None:
    from torch_checkpointing.storage.direct_io import DurableFileWriter

    data = os.urandom(40 * BLOCK_SIZE + 3)  # more than the O_DIRECT writer's 16 MiB buffer
    path = tmp_path / "f"
    with DurableFileWriter(str(path), direct_io) as stream:
        stream.write(data[:100])
        stream.write(data[100:])
    summed = stream.checksum()
    assert summed.crc32 == zlib.crc32(data) == stream.crc32 and summed.size == len(data)
    assert summed.blocks == BlockChecksums(BLOCK_SIZE, tuple(block_crc32s(memoryview(data), BLOCK_SIZE)))


def test_a_saved_file_is_recorded_with_its_block_crcs(tmp_path: Path) -> None:
    _save(tmp_path / "ck", {"a": torch.arange(N, dtype=torch.float32)}, reshard=False)
    rec = _record(tmp_path / "ck")
    data = (tmp_path / "ck" / "model_0.pt").read_bytes()
    assert rec["blocks"]["block_size"] == BLOCK_SIZE
    assert len(rec["blocks"]["crc32"]) == 8 * math.ceil(len(data) / BLOCK_SIZE)
    assert bytes.fromhex(rec["blocks"]["crc32"]) == b"".join(
        zlib.crc32(data[i : i + BLOCK_SIZE]).to_bytes(4, "big") for i in range(0, len(data), BLOCK_SIZE)
    )
    assert rec["crc32"] == zlib.crc32(data)


def test_manifest_size_for_one_gib_of_data() -> None:
    """The block list costs 8 hex digits per block: 32 KiB of manifest per GiB of data at 256 KiB blocks."""
    blocks = BlockChecksums(BLOCK_SIZE, tuple(range((1 << 30) // BLOCK_SIZE)))
    text = json.dumps(blocks.to_json())
    assert len(text) < 33 * 1024, len(text)


_BAD_BLOCKS = [
    ("a list", [1, 2], "field 'blocks' must be an object"),
    ("size as text", {"block_size": "262144", "crc32": ""}, r"blocks.block_size' has the wrong type"),
    ("tiny blocks", {"block_size": 1, "crc32": ""}, r"blocks.block_size' is 1, outside"),
    ("crcs as ints", {"block_size": BLOCK_SIZE, "crc32": [1]}, r"blocks.crc32' has the wrong type"),
    ("one block short", {"block_size": BLOCK_SIZE, "crc32": "00"}, r"blocks.crc32' holds .* blocks"),
    ("not hex", {"block_size": BLOCK_SIZE, "crc32": None}, r"blocks.crc32' has the wrong type"),
    ("extra key", {"block_size": BLOCK_SIZE, "crc32": "", "x-y": 1}, "exactly 'block_size' and 'crc32'"),
]


@pytest.mark.parametrize(("case", "blocks", "message"), _BAD_BLOCKS, ids=[c[0] for c in _BAD_BLOCKS])
def test_a_manifest_with_bad_block_fields_is_refused_naming_file_and_field(
    tmp_path: Path, case: str, blocks: Any, message: str
) -> None:
    _save(tmp_path / "ck", b"x" * (3 * BLOCK_SIZE), LayoutInfo("m.bin", RawSerialization()), reshard=False)
    d = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    d["items"]["model"]["0"]["blocks"] = blocks
    with pytest.raises(CorruptCheckpointError, match=rf"manifest.json: field 'items.model.0': .*{message}"):
        parse_manifest(json.dumps(d), "manifest.json")


def test_bad_hex_digits_are_refused() -> None:
    with pytest.raises(CorruptCheckpointError, match=r"field 'blocks.crc32' is not a hex string"):
        BlockChecksums.from_json({"block_size": BLOCK_SIZE, "crc32": "zz" * 4}, 10, "manifest.json")


def test_a_manifest_without_block_crcs_is_still_verified_whole(tmp_path: Path) -> None:
    """Checkpoints written before block checksums keep loading, checked against the whole-file CRC32."""
    root = tmp_path / "ck"
    _save(root, {"a": torch.arange(N, dtype=torch.float32), "b": torch.ones(N)})
    d = json.loads((root / "manifest.json").read_text())
    del d["items"]["model"]["0"]["blocks"]
    (root / "manifest.json").write_text(json.dumps(d))
    assert torch.equal(_partial_load(root)["a"], torch.arange(N, dtype=torch.float32))
    _flip(root / "model_0.pt", _offset_of(root / "model_0.pt", torch.ones(N)) + 4 * N // 2)  # in 'b' only
    with pytest.raises(CorruptCheckpointError, match=r"model_0.pt.*fails its CRC32 check \(manifest"):
        _partial_load(root)  # no blocks: the whole file is checked, so damage anywhere is found


# ---------------------------------------------------------------------------------- ranged verified reads


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _offset_of(path: Path, tensor: torch.Tensor) -> int:
    at = path.read_bytes().find(tensor.numpy().tobytes()[:256])
    assert at >= 0
    return at


def _partial_load(root: Path, layout: LayoutInfo | None = None) -> dict[str, torch.Tensor]:
    """A resharding load of tensor 'a' only: it reads a's byte range of the source file, never b's."""
    target = {"a": torch.zeros(N)}
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard(), layout=layout)})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.load(str(root), into={"model": target}, strict=False)
    finally:
        m.close()
    return target


LAYOUTS = [None, LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["torch", "safetensors"])
def test_damage_outside_every_range_read_is_not_read_and_damage_inside_is_refused_naming_the_block(
    tmp_path: Path, layout: LayoutInfo | None
) -> None:
    root = tmp_path / "ck"
    a, b = torch.arange(N, dtype=torch.float32), torch.arange(N, dtype=torch.float32) + 0.5
    _save(root, {"a": a, "b": b}, layout)
    name = "model_0.pt" if layout is None else "model_0.safetensors"
    file = root / name
    in_b, in_a = _offset_of(file, b) + 4 * N // 2, _offset_of(file, a) + 4 * N // 2
    _flip(file, in_b)
    # By design: the load reads only a's blocks, so damage in b (several blocks away) is not seen by it...
    assert torch.equal(_partial_load(root, layout)["a"], a)
    _flip(file, in_b)
    _flip(file, in_a)
    block = in_a // BLOCK_SIZE
    # ...and damage in a block it reads is refused, naming the file and the block.
    with pytest.raises(CorruptCheckpointError, match=rf"{name} .* fails its CRC32 check in block {block} of"):
        _partial_load(root, layout)


def _two_tensors_with_b_damaged(tmp_path: Path, layout: LayoutInfo | None) -> tuple[Path, str]:
    """A resharded checkpoint of tensors a and b with one bit flipped in the second half of b."""
    root = tmp_path / "ck"
    a, b = torch.arange(N, dtype=torch.float32), torch.arange(N, dtype=torch.float32) + 0.5
    _save(root, {"a": a, "b": b}, layout)
    name = "model_0.pt" if layout is None else "model_0.safetensors"
    _flip(root / name, _offset_of(root / name, b) + 4 * N // 2)
    return root, name


def assert_resharding_load_refused(root: Path, spec: ItemSpec, target: Any, match: str) -> None:
    """A resharding load of item "model" of `root` into `target` raises a CorruptCheckpointError matching
    `match` (the resharder's warning that it reads a plain, unsharded source is expected and ignored)."""
    m = _manager({"model": spec})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            with pytest.raises(CorruptCheckpointError, match=match):
                m.load(str(root), into={"model": target})
    finally:
        m.close()


@pytest.mark.parametrize("layout", LAYOUTS, ids=["torch", "safetensors"])
def test_a_resharding_load_that_meets_a_damaged_block_has_filled_no_target(
    tmp_path: Path, layout: LayoutInfo | None
) -> None:
    """All-or-nothing holds for resharding loads too: every planned block is checked before the first copy."""
    root, name = _two_tensors_with_b_damaged(tmp_path, layout)  # b is copied after a
    target = {"a": torch.zeros(N), "b": torch.zeros(N)}
    spec = ItemSpec(resharder=AlwaysReshard(), layout=layout)
    assert_resharding_load_refused(root, spec, target, rf"{name} .* fails its CRC32 check in block")
    assert not target["a"].any() and not target["b"].any()


def test_block_crcs_that_do_not_combine_to_the_file_crc_are_refused_as_a_damaged_manifest(tmp_path: Path) -> None:
    """The whole-file check trusts the block CRCs a later ranged read uses only if they combine to the file's CRC."""
    root = tmp_path / "ck"
    _save(root, {"a": torch.arange(N, dtype=torch.float32)}, reshard=False)
    d = json.loads((root / "manifest.json").read_text())
    rec = d["items"]["model"]["0"]
    hexed = rec["blocks"]["crc32"]
    rec["blocks"]["crc32"] = ("0" if hexed[0] != "0" else "1") + hexed[1:]  # the data is intact; a record is not
    (root / "manifest.json").write_text(json.dumps(d))
    m = _manager({"model": ItemSpec()})
    try:
        with pytest.raises(CorruptCheckpointError, match="manifest record is inconsistent"):
            m.load(str(root), into={"model": {"a": torch.zeros(N)}})
    finally:
        m.close()


def test_the_direct_loader_still_checks_every_byte_before_the_first_copy(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    a, b = torch.arange(N, dtype=torch.float32), torch.ones(N)
    _save(root, {"a": a, "b": b}, reshard=False)
    _flip(root / "model_0.pt", _offset_of(root / "model_0.pt", b) + 4 * N // 2)
    target = {"a": torch.zeros(N), "b": torch.zeros(N)}
    m = _manager({"model": ItemSpec()})
    try:
        with pytest.raises(CorruptCheckpointError, match=r"model_0.pt .* CRC32 check in block"):
            m.load(str(root), into={"model": target})
    finally:
        m.close()
    assert not target["a"].any() and not target["b"].any()


@pytest.fixture
def counted_preads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Bytes of every pread the read context issues on its held descriptors."""
    import torch_checkpointing.read_context as rc

    sizes: list[int] = []
    real = rc._pread_buffer

    def counting(fd: int, offset: int, length: int, *where: str) -> bytearray:
        sizes.append(length)
        return real(fd, offset, length, *where)

    monkeypatch.setattr(rc, "_pread_buffer", counting)
    yield sizes


def test_a_ranged_read_reads_only_the_blocks_it_touches(tmp_path: Path, counted_preads: list[int]) -> None:
    root = tmp_path / "ck"
    data = os.urandom(64 * BLOCK_SIZE)
    _save(root, data, LayoutInfo("m.bin", RawSerialization()), reshard=False)
    storage: Storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    with CheckpointReadContext(storage, str(root), ReadPolicy()) as ctx:
        counted_preads.clear()  # the manifest
        got = ctx.read_range("m.bin", 10 * BLOCK_SIZE + 5, 3 * BLOCK_SIZE)  # touches blocks 10..13
        assert got == data[10 * BLOCK_SIZE + 5 : 13 * BLOCK_SIZE + 5]
        assert sum(counted_preads) == 4 * BLOCK_SIZE
        counted_preads.clear()
        assert ctx.read_range("m.bin", 11 * BLOCK_SIZE, 100) == data[11 * BLOCK_SIZE : 11 * BLOCK_SIZE + 100]
        # Checked before, but bytes read again are checked again (the file may have been written into since):
        # the one block the range touches.
        assert counted_preads == [BLOCK_SIZE]
        ctx.wait_verified()  # nothing was read whole, so nothing more is read
        assert counted_preads == [BLOCK_SIZE]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["torch", "safetensors"])
def test_a_check_phase_finds_damage_in_a_planned_block_before_reading_it(
    tmp_path: Path, layout: LayoutInfo | None
) -> None:
    """`SourceTensor.check_block` lets a resharder check every planned block before its first copy."""
    from torch_checkpointing.checkpoint_layout import TorchSerialization
    from torch_checkpointing.source_reader import ReadStats, open_source_file

    root, name = _two_tensors_with_b_damaged(tmp_path, layout)
    fmt = TorchSerialization() if layout is None else SafetensorsSerialization()
    storage: Storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    with CheckpointReadContext(storage, str(root), ReadPolicy()) as ctx:
        source = open_source_file(ctx.storage_view(), root / name, fmt, ReadStats())
        tensor_a, tensor_b = source.tensor(("a",)), source.tensor(("b",))
        assert tensor_a is not None and tensor_b is not None
        tensor_a.check_block((0,), (N,))
        tensor_b.check_block((0,), (N // 4,))  # the first quarter of b: undamaged
        with pytest.raises(CorruptCheckpointError, match=rf"{name} .* fails its CRC32 check in block"):
            tensor_b.check_block((N // 2,), (N // 2,))


def test_without_isal_the_writer_combines_blocks_with_its_own_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_checkpointing.checksum as checksum

    monkeypatch.setattr(checksum, "_native_combine", None)
    monkeypatch.setattr(checksum, "_crc32", zlib.crc32)
    data = os.urandom(4 * BLOCK_SIZE + 1234)
    running = RunningChecksum()
    running.update(data[:1000])
    running.update(data[1000:])
    assert running.result().crc32 == zlib.crc32(data)
