"""Crafted checkpoints, round 14: files whose bytes pass the manifest's checksums (an attacker rewrites both)
but do not decode as their format says. docs/durability.md: "load() either returns exactly what was
committed, or raises a CheckpointError subclass whose message names the file and the reason", and changes
nothing in the caller's template.

What each case did before:
* a Torch pickle that holds itself, a persistent id too short, a tensor size that is a string: a bare
  ValueError / TypeError (NestingError) naming no file, on direct and resharding loads alike;
* a zip64 extra field shorter than it claims: a bare `struct.error`;
* a deflated tensor record: loaded, its compressed bytes returned as the tensor's values; a deflated pickle
  padded with zeros: inflated whole (1 GiB from a 1 MB file), then loaded;
* an int of 400 digits in the manifest's `commit_time` or `metrics`: a bare OverflowError, from load() and
  from list_checkpoints();
* a safetensors header naming one tensor twice: the direct load kept the last entry (another dtype);
* a sharding group listing no ranks: the resharded entry silently left as the template had it;
* one safetensors name of 50 000 dots: every prefix of it held in memory (gigabytes from a 98 KB file).
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_crafted_round9 import _assert_refused, _forge, _save, load_outcome
from tests.test_verified_loads import _edit_manifest, _reshard_save, _rewrite_metadata
from torch_checkpointing import list_checkpoints
from torch_checkpointing.errors import CorruptCheckpointError

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ crafted Torch pickles


class _Storage:
    def __init__(self, numel: Any) -> None:
        self.numel = numel


class _Tensor:
    """Pickles as torch's own tensor rebuild call, over a persistent storage id the pickler chooses."""

    def __init__(self, storage: _Storage, size: Any) -> None:
        self.args = (storage, 0, size, (1,), False, collections.OrderedDict())

    def __reduce__(self) -> tuple[Any, ...]:
        return (torch._utils._rebuild_tensor_v2, self.args)


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, pid: tuple[Any, ...]) -> None:
        super().__init__(file, protocol=2)
        self.pid = pid

    def persistent_id(self, obj: Any) -> Any:
        return self.pid if isinstance(obj, _Storage) else None


def _tensor_pickle(pid: tuple[Any, ...] | None = None, size: Any = (8,)) -> bytes:
    out = io.BytesIO()
    pid = pid or ("storage", torch.FloatStorage, "0", "cpu", 8)
    _Pickler(out, pid).dump({"w": _Tensor(_Storage(8), size)})
    return out.getvalue()


_PICKLES = {
    "a list that holds itself": b"\x80\x02]q\x00h\x00a.",
    "a persistent id too short": _tensor_pickle(pid=("storage", torch.FloatStorage)),
    "a tensor size that is a string": _tensor_pickle(size="abcd"),
}


def _rezip(data: bytes, replace: dict[str, bytes], deflate: str = "", pad: int = 0) -> bytes:
    """The Torch zip with entries ending in a `replace` key swapped; the entry ending in `deflate` deflated."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(out, "w") as zout:
        for info in zin.infolist():
            body = zin.read(info.filename)
            for suffix, new in replace.items():
                if info.filename.endswith(suffix):
                    body = new
            if deflate and info.filename.endswith(deflate):
                zout.writestr(zipfile.ZipInfo(info.filename), body + bytes(pad), compress_type=zipfile.ZIP_DEFLATED)
            else:
                zout.writestr(zipfile.ZipInfo(info.filename), body)
    return out.getvalue()


def _craft_torch(root: Path, rel: str, data: bytes) -> None:
    (root / rel).write_bytes(data)
    _forge(root, rel)


# Without mmap nothing walks a self-holding list (the merge refuses it as the wrong type for the template).
_DIRECT_CASES = [(case, True) for case in sorted(_PICKLES)] + [
    (case, False) for case in sorted(_PICKLES) if case != "a list that holds itself"
]


@pytest.mark.parametrize(("case", "use_mmap"), _DIRECT_CASES)
def test_a_torch_pickle_that_does_not_decode_is_refused_naming_the_file(
    tmp_path: Path, case: str, use_mmap: bool
) -> None:
    root = tmp_path / "ck"
    _save(root)
    _craft_torch(root, "model_0.pt", _rezip((root / "model_0.pt").read_bytes(), {"data.pkl": _PICKLES[case]}))
    outcome = load_outcome(str(root), use_mmap=use_mmap)
    _assert_refused(outcome, "model_0.pt", "cannot be decoded")
    assert outcome["raised"] == "UndecodableFileError", outcome


@pytest.mark.parametrize("case", sorted(_PICKLES))
def test_a_resharding_source_pickle_that_does_not_decode_is_refused_naming_the_file(tmp_path: Path, case: str) -> None:
    root, _ = _reshard_save(tmp_path)
    _craft_torch(root, "model_0.pt", _rezip((root / "model_0.pt").read_bytes(), {"data.pkl": _PICKLES[case]}))
    outcome = load_outcome(str(root), reshard=True)
    _assert_refused(outcome, "model_0.pt", "cannot be decoded")


def test_an_undecodable_file_is_still_the_value_error_its_parser_raised() -> None:
    """API_SURFACE: a JSON item missing a dataclass field raises ValueError; callers catching that still do."""
    from torch_checkpointing.errors import UndecodableFileError

    assert issubclass(UndecodableFileError, CorruptCheckpointError)
    assert issubclass(UndecodableFileError, ValueError) and issubclass(UndecodableFileError, TypeError)


# ------------------------------------------------------------------------------ the zip walk


def _patch_central(data: bytes, suffix: bytes, compressed: int, extra: bytes) -> bytes:
    """Rewrite the central directory entry of the record ending in `suffix`: its compressed size and extra."""
    eocd = data.rfind(b"PK\x05\x06")
    sig, disk, cd_disk, n_disk, count, _, cd_off, clen = struct.unpack_from("<4s4H2LH", data, eocd)
    entry = struct.Struct("<4s6H3L5H2L")
    pos, out = cd_off, []
    for _ in range(count):
        fields = list(entry.unpack_from(data, pos))
        nl, el, cl = fields[10], fields[11], fields[12]
        name = data[pos + 46 : pos + 46 + nl]
        old_extra = data[pos + 46 + nl : pos + 46 + nl + el]
        comment = data[pos + 46 + nl + el : pos + 46 + nl + el + cl]
        if name.endswith(suffix):
            fields[8], fields[11], old_extra = compressed, len(extra), extra
        out.append(entry.pack(*fields) + name + old_extra + comment)
        pos += 46 + nl + el + cl
    cd = b"".join(out)
    return data[:cd_off] + cd + struct.pack("<4s4H2LH", sig, disk, cd_disk, n_disk, count, len(cd), cd_off, clen)


@pytest.mark.parametrize("reshard", [False, True])
def test_a_zip64_extra_field_shorter_than_it_claims_is_refused_naming_the_file(tmp_path: Path, reshard: bool) -> None:
    root = _reshard_save(tmp_path)[0] if reshard else tmp_path / "ck"
    if not reshard:
        _save(root)
    crafted = _patch_central((root / "model_0.pt").read_bytes(), b"data/0", 0xFFFFFFFF, struct.pack("<HH", 1, 16))
    _craft_torch(root, "model_0.pt", crafted)
    _assert_refused(load_outcome(str(root), reshard=reshard), "model_0.pt", "extra field")


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_deflated_tensor_record_is_refused_not_returned_as_its_compressed_bytes(
    tmp_path: Path, use_mmap: bool
) -> None:
    root = tmp_path / "ck"
    _save(root)
    _craft_torch(root, "model_0.pt", _rezip((root / "model_0.pt").read_bytes(), {}, deflate="data/0"))
    _assert_refused(load_outcome(str(root), use_mmap=use_mmap), "model_0.pt", "compressed")


def test_a_deflated_pickle_is_refused_before_it_is_inflated(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    _save(root)
    bomb = _rezip((root / "model_0.pt").read_bytes(), {}, deflate="data.pkl", pad=64 << 20)
    assert len(bomb) < 1 << 20
    _craft_torch(root, "model_0.pt", bomb)
    _assert_refused(load_outcome(str(root)), "model_0.pt", "compressed")


# ------------------------------------------------------------------------------ the manifest


@pytest.mark.parametrize("field", ["commit_time", "metrics"])
def test_an_int_no_float_holds_in_the_manifest_is_refused_naming_the_field(tmp_path: Path, field: str) -> None:
    root = tmp_path / "runs" / "ck"
    _save(root)
    huge = 10**400

    def edit(d: dict[str, Any]) -> None:
        d[field] = huge if field == "commit_time" else {"loss": huge}

    _edit_manifest(root, edit)
    _assert_refused(load_outcome(str(root)), "manifest.json", field)
    assert list_checkpoints(str(root.parent)) == []  # skipped as damaged (logged), not an OverflowError


# ------------------------------------------------------------------------------ safetensors


def test_a_safetensors_header_naming_a_tensor_twice_is_refused_by_the_direct_load(tmp_path: Path) -> None:
    from tests.test_crafted_round9 import _safetensors_header, _write_safetensors

    root = tmp_path / "ck"
    _save(root, "safetensors")
    path = root / "model_0.safetensors"
    header, body = _safetensors_header(path)
    entry = dict(json.loads(header)["w"], dtype="I32")
    _write_safetensors(path, f'{header[:-1]}, "w": {json.dumps(entry)}}}', body)
    _forge(root, "model_0.safetensors")
    _assert_refused(load_outcome(str(root), "safetensors"), "model_0.safetensors", "'w'", "twice")


def test_a_safetensors_name_of_many_dots_loads_in_bounded_memory(tmp_path: Path) -> None:
    """The template's entries load; the extra entry comes back under its name; nothing near O(L^2) is held."""
    from tests.test_crafted_round9 import _write_safetensors

    root = tmp_path / "ck"
    _save(root, "safetensors")
    name = ".".join(["x"] * 50_000)
    header = {
        "w": {"dtype": "F32", "shape": [8], "data_offsets": [0, 32]},
        "v": {"dtype": "F32", "shape": [8], "data_offsets": [32, 64]},
        name: {"dtype": "F32", "shape": [1], "data_offsets": [64, 68]},
    }
    body = torch.arange(8.0).numpy().tobytes() + (torch.arange(8.0) + 100).numpy().tobytes() + bytes(4)
    _write_safetensors(root / "model_0.safetensors", json.dumps(header), body)
    _forge(root, "model_0.safetensors")
    script = textwrap.dedent(
        f"""
        import resource, warnings
        warnings.simplefilter("ignore")
        resource.setrlimit(resource.RLIMIT_AS, ({2 << 30}, {2 << 30}))
        from tests.test_crafted_round9 import load_outcome
        outcome = load_outcome({str(root)!r}, "safetensors")
        print("RESULT", outcome["raised"], outcome.get("values", {{}}).get("w"))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = done.stdout.split("RESULT", 1)[1].split(None, 1)
    # strict=True: the extra name is refused as an unexpected entry, but never as a MemoryError
    assert result[0] == "TemplateMismatchError", done.stdout


# ------------------------------------------------------------------------------ sharding metadata


def test_a_sharding_group_listing_no_ranks_is_refused_not_read_as_absent(tmp_path: Path) -> None:
    root, _ = _reshard_save(tmp_path)

    def empty_ranks(d: dict[str, Any]) -> None:
        d["metadata"]["model"]["nested_path_to_metadata"]['["w"]'][0]["ranks"] = []

    _rewrite_metadata(root, empty_ranks)
    for strict in (False, True):
        _assert_refused(load_outcome(str(root), reshard=True, strict=strict), "metadata.json", "no ranks")


# ------------------------------------------------------------------------------ the process around the load


def test_a_mapped_file_with_an_undecodable_name_does_not_fail_every_torch_load(tmp_path: Path) -> None:
    """The loader finds where torch mapped a file in /proc/self/maps, which it read as UTF-8: while any file
    whose name is not UTF-8 was mapped in the process (a dataset), every Torch load raised UnicodeDecodeError."""
    root = tmp_path / "ck"
    _save(root)
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/data\xff.bin"))
    odd.write_bytes(bytes(4096))
    script = textwrap.dedent(
        f"""
        import json, mmap, warnings
        warnings.simplefilter("ignore")
        from tests.test_crafted_round9 import load_outcome
        with open({str(odd)!r}, "rb") as f:
            held = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            outcome = load_outcome({str(root)!r})
        print("RESULT", json.dumps([outcome["raised"], outcome.get("values", {{}}).get("w")]))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.split("RESULT", 1)[1]) == [None, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]


# ------------------------------------------------------------------------------ a resharded item's extras


@pytest.mark.parametrize("strict", [True, False])
def test_a_saved_tensor_no_template_entry_receives_is_reported_on_a_resharding_load(
    tmp_path: Path, strict: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """durability.md: `strict=True` refuses entries the checkpoint holds and the template lacks, and a
    non-strict load logs them. A resharding load dropped such a saved tensor silently, strict or not."""
    from tests.test_verified_loads import AlwaysReshard, _manager
    from torch_checkpointing import ItemSpec
    from torch_checkpointing.errors import TemplateMismatchError

    items = {"model": ItemSpec(resharder=AlwaysReshard())}
    m = _manager(items)
    try:
        with pytest.warns(UserWarning, match="plain"):
            m.save(str(tmp_path / "ck"), {"model": {"w": torch.arange(8.0), "head": torch.ones(2)}})
        target = torch.full((8,), -1.0)
        if strict:
            with pytest.raises(TemplateMismatchError, match=r"not in the template \['model::head'\]"):
                m.load(str(tmp_path / "ck"), into={"model": {"w": target}}, strict=True)
            assert bool((target == -1.0).all())  # nothing restored
        else:
            with caplog.at_level("WARNING", logger="torch_checkpointing"):
                m.load(str(tmp_path / "ck"), into={"model": {"w": target}})
            assert torch.equal(target, torch.arange(8.0))
            assert "model::head" in caplog.text and "not in the template" in caplog.text, caplog.text
    finally:
        m.close()
