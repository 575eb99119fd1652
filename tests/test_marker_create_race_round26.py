"""Round 26: two creators of one `.incomplete` claim on `file://` or `memory://` were both told they created it.

fsspec's `pipe_file(mode="create")` there is "exists? then open('wb')": two ranks of one save (each calls `begin`),
or a save and gc, that create the marker at once both passed the check, both got True, and the second open
truncated the first's claim. A longer claim then kept its tail after a shorter one's bytes: the marker no longer
parsed as a claim (how tests/test_objstore_round22.py's two-rank test once read `None` from a snapshot), and a
reader between the truncate and the write read an empty marker, which counts as no claim and is taken over.
Now the create is one step: the bytes are written where no reader sees them, then linked under the marker's
name only if that name is free (`file://`); one lock of the process around the check and the write
(`memory://`, which lives in one).
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from torch_checkpointing.storage import fsspec_storage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

pytest.importorskip("fsspec")

ROUNDS = 200


def _storage(where: str, tmp_path: Path) -> FsspecStorage:
    url = f"file://{tmp_path}" if where == "file" else f"memory://{uuid.uuid4().hex}"
    storage = FsspecStorageConfig(url=url).create_storage()
    if where == "memory":
        storage.mkdir(Path("."))  # the root (memory:// has none yet)
    return storage


def _race(storage: FsspecStorage, marker: Path, payloads: list[bytes]) -> list[bool]:
    """Every payload's create_object at once, one thread each; what each was told."""
    start = threading.Barrier(len(payloads))
    told = [False] * len(payloads)

    def create(k: int) -> None:
        start.wait()
        told[k] = storage.create_object(marker, payloads[k])

    threads = [threading.Thread(target=create, args=(k,)) for k in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return told


@pytest.mark.parametrize("where", ["file", "file without O_TMPFILE", "memory"])
def test_of_creators_racing_for_one_marker_exactly_one_is_told_it_created_it_and_holds_it_whole(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "file without O_TMPFILE":  # the hidden named file, as on NFS or off Linux
        monkeypatch.setattr(fsspec_storage, "_HAS_TMPFILE_LINKS", False)
    storage = _storage(where.split()[0], tmp_path)
    payloads = [b'{"claim": "rank 0, the longer one"}', b'{"claim": "rank 1"}']
    wrong: list[str] = []
    for i in range(ROUNDS):
        root = Path(f"r{i}")
        storage.mkdir(root, recursive=False)
        told = _race(storage, root / ".incomplete", payloads)
        held = storage.read(root / ".incomplete")
        if told.count(True) != 1 or held != payloads[told.index(True)]:
            wrong.append(f"round {i}: told {told}, the marker holds {held!r}")
        if [Path(name).name for name in storage.ls(root)] != [".incomplete"]:  # no hidden file left beside it
            wrong.append(f"round {i}: the folder holds {storage.ls(root)}")
    assert not wrong, f"{len(wrong)} of {ROUNDS} rounds: {wrong[:3]}"


def test_a_reader_never_reads_a_marker_being_created_as_empty_or_partial(tmp_path: Path) -> None:
    """An empty marker counts as no claim (a save takes it over): a reader must see none, or the whole claim."""
    storage = _storage("file", tmp_path)
    claim = b'{"claim": "' + b"x" * 4000 + b'"}'
    seen: set[bytes | None] = set()
    for i in range(ROUNDS // 2):
        root = Path(f"r{i}")
        storage.mkdir(root, recursive=False)
        done = threading.Event()

        def read(marker: Path = root / ".incomplete", done: threading.Event = done) -> None:
            while not done.is_set():
                found = storage.read_object(marker)
                seen.add(None if found is None else found[0])

        reader = threading.Thread(target=read)
        reader.start()
        try:
            assert storage.create_object(root / ".incomplete", claim)
        finally:
            done.set()
            reader.join(60)
    assert seen <= {None, claim}, sorted(len(s) for s in seen if s is not None)
