"""Crafted checkpoints that try to exhaust resources or slip past a check (issue 10, round 9).

The adversary controls the whole checkpoint directory: manifest, metadata and data files alike, with every
checksum forged to match. Each load runs in a child process under a wall-clock timeout and an address-space
limit (`RLIMIT_AS`), so a hang or a memory bomb fails the test instead of stalling the machine. Each case must
be refused with a `CheckpointError` naming the file and the field, the caller's template unchanged, or load
exactly what was saved.

Each test failed on the code before its fix, except where its docstring says it pins behaviour that held.
"""

from __future__ import annotations

import collections
import io
import json
import logging
import os
import resource
import struct
import subprocess
import sys
import textwrap
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_verified_loads import WholeFileResharder, _edit_manifest, _manager, _reshard_save, _rewrite_metadata
from torch_checkpointing import ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, SafetensorsSerialization
from torch_checkpointing.errors import CorruptCheckpointError

REPO = Path(__file__).resolve().parents[1]
CHILD_AS_BYTES = 4 << 30  # a memory bomb fails the child's allocation instead of the machine
CHILD_TIMEOUT_S = 120  # the refusals below take seconds; a hang is a failure
FILL = -1.0


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))


def in_child(call: str, module: str = "tests.test_crafted_round9") -> dict[str, Any]:
    """Run `call` (an expression over `module`'s names returning a JSON-able dict) in a fresh interpreter
    with bounded time and address space; its result comes back on the last line of stdout."""
    script = textwrap.dedent(
        f"""
        import json, warnings
        warnings.simplefilter("ignore")
        from {module} import *
        print("RESULT " + json.dumps({call}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        preexec_fn=_limit_memory,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"child failed ({done.returncode}): {done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def _template() -> dict[str, torch.Tensor]:
    return {"w": torch.full((8,), FILL), "v": torch.full((8,), FILL)}


def load_outcome(
    root: str, layout: str = "torch", reshard: bool = False, use_mmap: bool = True, strict: bool = True
) -> dict[str, Any]:
    """(child side) Load `root` into a template filled with FILL: what was raised, and whether it changed."""
    from tests.test_verified_loads import AlwaysReshard

    spec = ItemSpec(layout=_LAYOUTS[layout], resharder=AlwaysReshard() if reshard else None)
    m = _manager({"model": spec}, use_mmap=use_mmap)
    template = {"w": torch.full((4096,), FILL)} if reshard else _template()
    try:
        loaded = m.load(root, into={"model": template}, strict=strict)["model"]
        outcome: dict[str, Any] = {"raised": None, "values": {k: v.tolist()[:8] for k, v in loaded.items()}}
    except Exception as exc:
        outcome = {
            "raised": type(exc).__name__,
            "message": str(exc),
            "corrupt": isinstance(exc, CorruptCheckpointError),
        }
    finally:
        m.close()
    outcome["unchanged"] = all(bool((t == FILL).all()) for t in template.values())
    return outcome


_LAYOUTS: dict[str, LayoutInfo | None] = {
    "torch": None,
    "safetensors": LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization()),
}


def _save(root: Path, layout: str = "torch") -> None:
    m = _manager({"model": ItemSpec(layout=_LAYOUTS[layout])})
    try:
        m.save(str(root), {"model": {"w": torch.arange(8.0), "v": torch.arange(8.0) + 100}})
    finally:
        m.close()


def _forge(root: Path, rel: str, key: str = "model") -> None:
    """Rewrite the manifest record of `rel` to match its crafted bytes (blocks dropped: the whole CRC matches)."""
    data = (root / rel).read_bytes()

    def forge(d: dict[str, Any]) -> None:
        d["items"][key]["0"].update(size=len(data), crc32=zlib.crc32(data))
        d["items"][key]["0"].pop("blocks", None)

    _edit_manifest(root, forge)


def _assert_refused(outcome: dict[str, Any], *needles: str) -> None:
    assert outcome["raised"] is not None, f"loaded a crafted checkpoint: {outcome}"
    assert outcome["corrupt"], outcome
    for needle in needles:
        assert needle in outcome["message"], (needle, outcome["message"])
    assert outcome["unchanged"], outcome


# ------------------------------------------------------------ 1. duplicate keys in the engine's JSON files


def _duplicate_in_manifest_record(root: Path) -> None:
    """The record says `"size": 1` and then its real size: json.loads kept the last one, silently."""
    text = (root / "manifest.json").read_text()
    size = json.loads(text)["items"]["model"]["0"]["size"]
    crafted = text.replace(f'"size": {size}', f'"size": 1, "size": {size}', 1)
    assert crafted != text
    (root / "manifest.json").write_text(crafted)


def _duplicate_item_in_manifest(root: Path) -> None:
    """Two `"model"` entries in `items`: one reader may check the first, another the second."""
    d = json.loads((root / "manifest.json").read_text())
    items = json.dumps(d.pop("items"))
    body = json.dumps(d)[:-1]
    decoy = items[1:-1].replace('"size": ', '"size": 7', 1)
    (root / "manifest.json").write_text(f'{body}, "items": {{{decoy}, {items[1:-1]}}}}}')


@pytest.mark.parametrize("craft", [_duplicate_in_manifest_record, _duplicate_item_in_manifest])
def test_a_manifest_with_a_duplicate_key_is_refused_naming_it(tmp_path: Path, craft: Any) -> None:
    root = tmp_path / "ck"
    _save(root)
    craft(root)
    key = "size" if craft is _duplicate_in_manifest_record else "model"
    _assert_refused(in_child(f"load_outcome({str(root)!r})"), "manifest.json", f"'{key}'", "twice")


def test_sharding_metadata_with_a_duplicate_key_is_refused_naming_it(tmp_path: Path) -> None:
    """metadata.json naming its world size twice: json.loads kept the last value, silently."""
    root, _ = _reshard_save(tmp_path)
    _rewrite_metadata(root, lambda d: None)
    text = (root / "metadata.json").read_text()
    crafted = text.replace('"world_size": 1', '"world_size": 5, "world_size": 1', 1)
    assert crafted != text
    (root / "metadata.json").write_text(crafted)
    _rewrite_metadata_bytes(root)
    _assert_refused(in_child(f"load_outcome({str(root)!r}, reshard=True)"), "metadata.json", "'world_size'", "twice")


def _rewrite_metadata_bytes(root: Path) -> None:
    data = (root / "metadata.json").read_bytes()

    def forge(m: dict[str, Any]) -> None:
        m["metadata_size"], m["metadata_crc32"] = len(data), zlib.crc32(data)

    _edit_manifest(root, forge)


def _safetensors_header(path: Path) -> tuple[str, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n].decode().rstrip(), data[8 + n :]


def _write_safetensors(path: Path, header: str, body: bytes) -> None:
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def test_a_safetensors_source_naming_a_tensor_twice_is_refused_by_the_ranged_reader(tmp_path: Path) -> None:
    """A resharding load reads a safetensors source through its own header parser (json.loads: the last
    entry of a name won), while safetensors' own reader serves the direct load: two readers, two answers."""
    from torch_checkpointing.source_reader import _read_safetensors_header
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    layout = LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())
    root, _ = _reshard_save(tmp_path, layout)
    path = root / "model_0.safetensors"
    header, body = _safetensors_header(path)
    entry = json.loads(header)["w"]
    half = dict(entry, shape=[2048], data_offsets=[0, 8192])
    _write_safetensors(path, f'{header[:-1]}, "w": {json.dumps(half)}}}', body)
    storage = LocalFileSystemStorageConfig().create_storage()
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.safetensors.*'w'.*twice"):
        _read_safetensors_header(storage, path)


def test_a_json_item_file_with_a_duplicate_key_is_refused_naming_it(tmp_path: Path) -> None:
    """json.dumps never writes a key twice, so a JSON item holding one is crafted or damaged."""
    root = tmp_path / "ck"
    layout = LayoutInfo("extra.json", JsonSerialization())
    m = _manager({"extra": ItemSpec(layout=layout)})
    try:
        m.save(str(root), {"extra": {"lr": 0.1}})
        (root / "extra.json").write_text('{"lr": 0.1, "lr": 9.0}')
        _forge(root, "extra.json", key="extra")
        with pytest.raises(CorruptCheckpointError, match=r"extra\.json.*'lr'.*twice"):
            m.load(str(root))
    finally:
        m.close()


# ------------------------------------------------------------ 2. a Torch zip with a million entries


def _flood_zip(path: Path, entries: int) -> None:
    """Append `entries` empty records to a Torch file (names torch.save never writes)."""
    with zipfile.ZipFile(path) as original:
        records = [(info, original.read(info)) for info in original.infolist()]
    prefix = records[0][0].filename.split("/")[0]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        for info, data in records:
            z.writestr(info, data)
        for i in range(entries):
            z.writestr(f"{prefix}/junk{i}", b"")
    path.write_bytes(buffer.getvalue())


def test_a_torch_file_with_a_million_entries_is_refused_quickly(tmp_path: Path) -> None:
    """The records walk built a ZipInfo object per entry (26 s and over 1 GiB for 10**6 empty entries in a
    100 MB file); entries torch.save never writes are refused, naming the file and the entry."""
    root = tmp_path / "ck"
    _save(root)
    _flood_zip(root / "model_0.pt", 10**6)
    _forge(root, "model_0.pt")
    import time

    began = time.monotonic()
    outcome = in_child(f"load_outcome({str(root)!r})")
    _assert_refused(outcome, "model_0.pt", "junk")
    assert time.monotonic() - began < 30, "refused, but slowly"
    os.remove(root / "model_0.pt")


@pytest.mark.parametrize("use_mmap", [True, False])
def test_bytes_after_the_zip_directory_are_refused_not_read_as_a_legacy_file(tmp_path: Path, use_mmap: bool) -> None:
    """The hand-made directory walk took a zip whose end record was followed by bytes for a legacy (non-zip)
    file and returned no records, so the check that each storage fits its record was skipped, while torch read
    the zip as usual (it ignores what follows)."""
    root = tmp_path / "ck"
    _save(root)
    with open(root / "model_0.pt", "ab") as file:
        file.write(b"appended")
    _forge(root, "model_0.pt")
    outcome = in_child(f"load_outcome({str(root)!r}, use_mmap={use_mmap})")
    _assert_refused(outcome, "model_0.pt", "follow the zip's end-of-directory record")


# ------------------------------------------------------------ 3. a custom resharder's load into tied targets


class PairResharder(WholeFileResharder):
    """A custom `load` that fills `a` and `b` from the saved file itself: the engine never sees its copies."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        self.events.append("load")
        data = storage.read(source_metadata.get_file_path(0, source_path, item_key))
        saved = torch.load(io.BytesIO(data), weights_only=True)
        for name in ("a", "b"):
            target[name].copy_(saved[name])
        return []


class _Events(logging.Handler):
    def __init__(self, events: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append(record.getMessage())


def _load_tied_pair(tmp_path: Path, tied: bool) -> tuple[list[str], torch.Tensor]:
    events: list[str] = []
    m = _manager({"model": ItemSpec(resharder=PairResharder(events))})
    handler = _Events(events)
    logger = logging.getLogger("torch_checkpointing")
    logger.addHandler(handler)
    try:
        m.save(str(tmp_path / "ck"), {"model": {"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}})
        shared = torch.zeros(64)
        template = {"a": shared, "b": shared if tied else torch.zeros(64)}
        m.load(str(tmp_path / "ck"), into={"model": template})
    finally:
        logger.removeHandler(handler)
        m.close()
    return events, shared


def test_tied_targets_of_a_custom_resharders_load_are_named_before_it_runs(tmp_path: Path) -> None:
    """A custom `load` fills the template itself, so the engine cannot compare what it writes into two entries
    sharing one tensor (the DTensor and direct paths refuse different values before any copy). The limit is
    stated on `Resharder`; the load logs a WARNING naming both entries before the resharder runs, where it was
    silent and the last write won (here `b`'s 2.0 in `a` too)."""
    events, shared = _load_tied_pair(tmp_path, tied=True)
    warned = [e for e in events if "share memory" in e]
    assert len(warned) == 1 and "'model::a'" in warned[0] and "'model::b'" in warned[0], events
    assert "PairResharder" in warned[0] and events.index(warned[0]) < events.index("load"), events
    assert torch.equal(shared, torch.full((64,), 2.0))  # the stated limit: the resharder's last write won


def test_untied_targets_of_a_custom_resharder_say_nothing(tmp_path: Path) -> None:
    """Pins what held: no warning where no two entries share memory."""
    events, shared = _load_tied_pair(tmp_path, tied=False)
    assert events == ["load"] and torch.equal(shared, torch.full((64,), 1.0))


def test_the_resharder_contract_states_the_tied_target_limit() -> None:
    from torch_checkpointing.resharding import Resharder

    assert "share memory" in (Resharder.__doc__ or "") and "cannot" in (Resharder.__doc__ or "")


# ------------------------------------------------------------ 4. crafted pickles in a Torch file


class _Calls:
    """Pickles as a call of `func(*args)`: what a crafted file runs if its loader unpickles freely."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _replace_item_file(root: Path, value: Any) -> None:
    """The item file is replaced by `torch.save(value)`, its manifest record forged to match."""
    torch.save(value, root / "model_0.pt")
    _forge(root, "model_0.pt")


def _code_runners(canary: Path) -> dict[str, Any]:
    return {
        "os.system": _Calls(os.system, f"touch {canary}"),
        "builtins.eval": _Calls(eval, f"open({str(canary)!r}, 'w').close()"),
        "builtins.exec": _Calls(exec, f"open({str(canary)!r}, 'w').close()"),
        "torch.load": _Calls(torch.load, str(canary)),
    }


@pytest.mark.parametrize("runner", ["os.system", "builtins.eval", "builtins.exec", "torch.load"])
@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_pickle_naming_code_is_refused_and_never_runs(tmp_path: Path, runner: str, use_mmap: bool) -> None:
    """Pins what held, under the real thing: the default (weights_only) load refuses each, naming the file and
    the global, and the canary the code would create does not appear."""
    root, canary = tmp_path / "ck", tmp_path / "canary"
    _save(root)
    _replace_item_file(root, {"w": _code_runners(canary)[runner], "v": torch.zeros(8)})
    outcome = in_child(f"load_outcome({str(root)!r}, use_mmap={use_mmap})")
    _assert_refused(outcome, "model_0.pt", runner.split(".")[-1])
    assert outcome["raised"] == "RefusedPickleError" and not canary.exists()


def test_a_resharding_source_naming_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    """The neighbour: the same crafted pickle as a resharder's source file."""
    root, _ = _reshard_save(tmp_path)
    canary = tmp_path / "canary"
    _replace_item_file(root, {"w": _Calls(os.system, f"touch {canary}")})
    outcome = in_child(f"load_outcome({str(root)!r}, reshard=True)")
    _assert_refused(outcome, "model_0.pt", "system")
    assert outcome["raised"] == "RefusedPickleError" and not canary.exists()


def _rebuilt(storage: torch.TypedStorage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> _Calls:
    """A tensor record rebuilt by torch's own `_rebuild_tensor_v2` (which the safe loader allows) with crafted
    geometry."""
    return _Calls(torch._utils._rebuild_tensor_v2, storage, offset, size, stride, False, collections.OrderedDict())


GEOMETRIES = {
    "offset past the storage": (100, (8,), (1,)),
    "stride past the storage": (0, (8,), (3,)),
    "size past the storage": (0, (9,), (1,)),
    "negative stride": (7, (8,), (-1,)),
    "negative offset": (-4, (8,), (1,)),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_tensor_record_pointing_outside_its_storage_is_refused(tmp_path: Path, name: str, use_mmap: bool) -> None:
    """Pins what held: torch's `set_` bounds check refuses each geometry, read whole or mapped, and the
    refusal is a `CorruptCheckpointError` naming the file: never a view of bytes outside the storage."""
    root = tmp_path / "ck"
    _save(root)
    storage = torch.arange(8.0).untyped_storage()
    typed = torch.TypedStorage(wrap_storage=storage, dtype=torch.float32, _internal=True)
    _replace_item_file(root, {"w": _rebuilt(typed, *GEOMETRIES[name]), "v": torch.zeros(8)})
    _assert_refused(in_child(f"load_outcome({str(root)!r}, use_mmap={use_mmap})"), "model_0.pt")


def test_two_tensors_over_one_crafted_storage_load_exactly_their_views(tmp_path: Path) -> None:
    """Pins what held: `w` and `v` overlapping inside one 12-float storage are two in-bounds views; each
    template receives its own view's values, nothing from outside the storage."""
    root = tmp_path / "ck"
    _save(root)
    base = torch.arange(12.0)
    _replace_item_file(root, {"w": base[0:8], "v": base[4:12]})
    outcome = in_child(f"load_outcome({str(root)!r})")
    assert outcome["raised"] is None, outcome
    assert outcome["values"] == {"w": list(range(8)), "v": list(range(4, 12))}


def test_a_resharding_source_with_a_million_entries_is_refused_quickly(tmp_path: Path) -> None:
    """The neighbour: the same flood in a resharder's source file, read through the verifying view."""
    root, _ = _reshard_save(tmp_path)
    _flood_zip(root / "model_0.pt", 10**6)
    _forge(root, "model_0.pt")
    outcome = in_child(f"load_outcome({str(root)!r}, reshard=True)")
    _assert_refused(outcome, "model_0.pt", "junk")
    os.remove(root / "model_0.pt")


def test_a_torch_file_naming_one_record_twice_is_refused(tmp_path: Path) -> None:
    """Two entries named `data/0`: our records walk and torch's reader could each take another one."""
    root = tmp_path / "ck"
    _save(root)
    path = root / "model_0.pt"
    with zipfile.ZipFile(path) as original:
        records = [(info, original.read(info)) for info in original.infolist()]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        for info, data in records:
            z.writestr(info, data)
        first = next(info for info, _ in records if info.filename.endswith("/data/0"))
        z.writestr(first.filename, torch.full((8,), 7.0).numpy().tobytes())
    path.write_bytes(buffer.getvalue())
    _forge(root, "model_0.pt")
    _assert_refused(in_child(f"load_outcome({str(root)!r})"), "model_0.pt", "data/0", "twice")


@pytest.mark.parametrize("form", ["zip64 local headers", "zip64 directory"])
def test_the_records_walk_reads_zip64_files_as_zipfile_does(tmp_path: Path, form: str) -> None:
    """The hand-written directory walk agrees with `zipfile` on the 64-bit forms torch writes for large
    files (a zip64 extra field in each local header; a zip64 end record past 65535 entries)."""
    from torch_checkpointing.codecs import tensor_records

    tensors = {f"t{i}": torch.full((2,), float(i)) for i in range(70_000 if form == "zip64 directory" else 3)}
    plain = io.BytesIO()
    torch.save(tensors, plain)
    rewritten = io.BytesIO()
    with zipfile.ZipFile(plain) as original, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_STORED) as z:
        for info in original.infolist():
            with z.open(info.filename, "w", force_zip64=form == "zip64 local headers") as out:
                out.write(original.read(info))
    data = rewritten.getvalue()
    assert (b"PK\x06\x06" in data) == (form == "zip64 directory")
    expected = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            if "/data/" in info.filename and ".data/" not in info.filename:
                name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
                expected[info.header_offset + 30 + name_len + extra_len] = info.compress_size
    assert tensor_records(io.BytesIO(data)) == expected
    assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["t2"], tensors["t2"])


def test_a_zip64_extra_field_gives_the_64_bit_size_and_offset() -> None:
    """A directory entry of a file past 4 GiB holds 0xFFFFFFFF in its 32-bit fields and the values in its
    zip64 extra field (id 1: uncompressed size, compressed size, header offset, each present only if needed)."""
    from torch_checkpointing.codecs import _zip64_extra

    big = 0xFFFFFFFF
    extra = struct.pack("<HH", 0x5455, 1) + b"\0" + struct.pack("<HH3Q", 1, 24, 5 << 32, 5 << 32, 6 << 32)
    assert _zip64_extra(extra, big, big, big) == (5 << 32, 5 << 32, 6 << 32)
    assert _zip64_extra(struct.pack("<HHQ", 1, 8, 6 << 32), 10, 10, big) == (10, 10, 6 << 32)
    assert _zip64_extra(b"", 10, 10, 20) == (10, 10, 20)


# ------------------------------------------------------------ 5. declared sizes the files do not hold


def _header_of_2_60(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**60) + data[8:])


def _overlapping_offsets(path: Path) -> None:
    header, body = _safetensors_header(path)
    entries = json.loads(header)
    entries["w"]["data_offsets"] = entries["v"]["data_offsets"]
    _write_safetensors(path, json.dumps(entries), body)


def _offsets_past_the_file(path: Path) -> None:
    header, body = _safetensors_header(path)
    entries = json.loads(header)
    entries["w"].update(shape=[2**40], data_offsets=[0, 2**42])
    _write_safetensors(path, json.dumps(entries), body)


@pytest.mark.parametrize(
    ("craft", "reshard"),
    # a resharded save holds `w` alone, so the overlap is the direct case's only
    [
        (_header_of_2_60, False),
        (_overlapping_offsets, False),
        (_offsets_past_the_file, False),
        (_header_of_2_60, True),
        (_offsets_past_the_file, True),
    ],
)
def test_a_safetensors_file_declaring_what_it_does_not_hold_is_refused(
    tmp_path: Path, craft: Any, reshard: bool
) -> None:
    """Pins what held: a header length of 2**60, offsets shared by two tensors, a [2**40] tensor past the
    file's end: each refused before anything is allocated, by safetensors' reader (direct) or ours (resharded)."""
    layout = LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())
    if reshard:
        root, _ = _reshard_save(tmp_path, layout)
    else:
        root = tmp_path / "ck"
        _save(root, "safetensors")
    craft(root / "model_0.safetensors")
    _forge(root, "model_0.safetensors")
    outcome = in_child(f"load_outcome({str(root)!r}, 'safetensors', reshard={reshard})")
    _assert_refused(outcome, "model_0.safetensors")


def test_sharding_metadata_declaring_a_tensor_of_2_40_elements_is_refused_before_allocating(tmp_path: Path) -> None:
    """A global shape of [2**40] against a 4096-element target is refused at once, as damage: the saved shards do
    not fit it (it was a TemplateMismatchError until the shards were checked against the metadata)."""
    root, _ = _reshard_save(tmp_path)

    def huge(d: dict[str, Any]) -> None:
        group = d["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]
        group["sharding_metadata"]["data"]["global_shape"] = [2**40]

    _rewrite_metadata(root, huge)
    outcome = in_child(f"load_outcome({str(root)!r}, reshard=True)")
    assert outcome["raised"] == "CorruptCheckpointError" and "1099511627776" in outcome["message"], outcome
    assert outcome["unchanged"], outcome
