"""Crafted checkpoints found by mutation fuzzing (round 16). Each file's bytes pass the manifest's checksums
(an attacker rewrites both). Spec (docs/durability.md): "load() either returns exactly what was committed, or
raises a CheckpointError subclass that names the file and the reason, and then has changed nothing in the
caller's objects". Each load runs in a child under a time and address-space limit (`in_child`).

What each case did before:
* a Torch pickle whose persistent id is an int, not a tuple: torch's loader asserts, and the bare
  `AssertionError: saved_id must be a tuple, got int` escaped, naming no file, from direct and resharding
  loads alike;
* a tensor record's local zip header with its name length or extra-field length changed: torch read the
  record from the shifted offset and the load returned other values than were saved (the bytes one off,
  the last byte taken from the next entry's header), with no error. Such a file is not a valid zip: the
  local name no longer matches the directory's, or the record runs into the next entry.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import pytest

from tests.test_crafted_round9 import _assert_refused, _save, in_child
from tests.test_crafted_round14 import _craft_torch, _rezip
from tests.test_verified_loads import _reshard_save

# PROTO 2, BININT1 5, BINPERSID, STOP: a persistent id torch's loader asserts is a tuple.
_INT_PERSISTENT_ID = b"\x80\x02K\x05Q."


@pytest.mark.parametrize("use_mmap", [True, False])
def test_a_persistent_id_that_is_not_a_tuple_is_refused_naming_the_file(tmp_path: Path, use_mmap: bool) -> None:
    """Defect: a bare AssertionError from torch's persistent_load, not a CheckpointError naming the file."""
    root = tmp_path / "ck"
    _save(root)
    _craft_torch(root, "model_0.pt", _rezip((root / "model_0.pt").read_bytes(), {"data.pkl": _INT_PERSISTENT_ID}))
    outcome = in_child(f"load_outcome({str(root)!r}, use_mmap={use_mmap})")
    _assert_refused(outcome, "model_0.pt", "cannot be decoded")


def test_a_resharding_source_whose_persistent_id_is_not_a_tuple_is_refused(tmp_path: Path) -> None:
    """Defect: the same bare AssertionError from a resharding load's source file."""
    root, _ = _reshard_save(tmp_path)
    _craft_torch(root, "model_0.pt", _rezip((root / "model_0.pt").read_bytes(), {"data.pkl": _INT_PERSISTENT_ID}))
    outcome = in_child(f"load_outcome({str(root)!r}, reshard=True)")
    _assert_refused(outcome, "model_0.pt", "cannot be decoded")


def _shift_local_header(data: bytes, field: int, delta: int) -> bytes:
    """`data` with the 16-bit field at `field` (26: name length, 28: extra length) of the local header of the
    first tensor record (`.../data/0`) moved by `delta`."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        at = next(i.header_offset for i in z.infolist() if i.filename.endswith("/data/0"))
    (value,) = struct.unpack_from("<H", data, at + field)
    return data[: at + field] + struct.pack("<H", value + delta) + data[at + field + 2 :]


_SHIFTS = {"extra length + 1": (28, 1), "extra length - 4": (28, -4), "name length + 1": (26, 1)}


@pytest.mark.parametrize("use_mmap", [True, False])
@pytest.mark.parametrize("shift", sorted(_SHIFTS))
def test_a_tensor_record_header_shifted_is_refused_not_misread(tmp_path: Path, shift: str, use_mmap: bool) -> None:
    """Defect: a shifted local header made torch read a tensor one offset off; the load returned those
    values silently instead of "exactly what was committed, or a CheckpointError naming the file"."""
    root = tmp_path / "ck"
    _save(root)
    crafted = _shift_local_header((root / "model_0.pt").read_bytes(), *_SHIFTS[shift])
    _craft_torch(root, "model_0.pt", crafted)
    _assert_refused(in_child(f"load_outcome({str(root)!r}, use_mmap={use_mmap})"), "model_0.pt")


def test_a_resharding_source_with_a_shifted_tensor_record_is_refused(tmp_path: Path) -> None:
    """Defect: the same shifted record, read by a resharding load, came back as other values."""
    root, _ = _reshard_save(tmp_path)
    _craft_torch(root, "model_0.pt", _shift_local_header((root / "model_0.pt").read_bytes(), 28, 1))
    _assert_refused(in_child(f"load_outcome({str(root)!r}, reshard=True)"), "model_0.pt")
