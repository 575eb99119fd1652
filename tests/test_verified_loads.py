"""Issue 10: `load()` returns exactly what was committed, or raises a `CheckpointError` naming the file and the
reason, having changed nothing in the caller's objects. One test (or a few) per point of the issue.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import (
    JsonSerialization,
    LayoutInfo,
    RawSerialization,
    SafetensorsSerialization,
)
from torch_checkpointing.checkpoint_loader import CheckpointLoader
from torch_checkpointing.config import CheckpointLoaderConfig, SyncCheckpointSaverConfig
from torch_checkpointing.distributed_metadata import DistributedItemMetadata
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    TemplateMismatchError,
    UnsafeCheckpointError,
)
from torch_checkpointing.resharding import Resharder
from torch_checkpointing.schema import resolve
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.types import RankInfo

ROOT = Path(__file__).resolve().parents[1]


class AlwaysReshard(DTensorResharder):
    """DTensorResharder that reshards even at an unchanged layout: the resharded read path on one process."""

    def should_reshard(self, source_metadata: DistributedItemMetadata | None, target_metadata: Any) -> bool:
        return source_metadata is not None and target_metadata is not None


def _manager(items: dict[str, ItemSpec] | None = None, **load: Any) -> CheckpointManager:
    return CheckpointManager(
        CheckpointManager.Config(
            items=items or {}, save=SyncCheckpointSaverConfig(), load=CheckpointLoaderConfig(**load)
        )
    )


def _loader(**load: Any) -> CheckpointLoader:
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    return CheckpointLoader(storage, CheckpointLoaderConfig(**load), RankInfo.single())


@pytest.fixture
def mgr() -> Iterator[CheckpointManager]:
    m = _manager()
    yield m
    m.close()


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    d = _manifest(root)
    edit(d)
    (root / "manifest.json").write_text(json.dumps(d))


def _rewrite_metadata(root: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Craft metadata.json and forge the manifest to match (an attacker controls both)."""
    d = json.loads((root / "metadata.json").read_text())
    edit(d)
    data = json.dumps(d).encode()
    (root / "metadata.json").write_bytes(data)

    def forge(m: dict[str, Any]) -> None:
        m["metadata_size"], m["metadata_crc32"] = len(data), zlib.crc32(data)

    _edit_manifest(root, forge)


def _offset_of(data: bytes, needle: bytes) -> int:
    at = data.find(needle)
    assert at >= 0
    return at


def _reshard_save(tmp_path: Path, layout: LayoutInfo | None = None) -> tuple[Path, torch.Tensor]:
    value = torch.arange(4096, dtype=torch.float32)
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard(), layout=layout)})
    try:
        with pytest.warns(UserWarning, match=r"plain"):
            m.save(str(tmp_path / "ck"), {"model": {"w": value}})
    finally:
        m.close()
    return tmp_path / "ck", value


def _reshard_load(root: Path, layout: LayoutInfo | None = None, **load: Any) -> tuple[Any, torch.Tensor]:
    target = torch.zeros(4096)
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard(), layout=layout)}, **load)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            return m.load(str(root), into={"model": {"w": target}}, strict=True), target
    finally:
        m.close()


# ---------------------------------------------------------------------------------- 1. code execution


def test_metadata_naming_a_class_never_imports_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _value = _reshard_save(tmp_path)
    marker = tmp_path / "ran"
    (root / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Thing: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def craft(d: dict[str, Any]) -> None:
        d["metadata"]["model"]["rank_to_layout_info"]["0"] = {
            "file_path": "model_0.pt",
            "serialization_format": {"type": "JsonSerialization", "cls": "ck.evil.Thing"},
        }

    _rewrite_metadata(root, craft)
    with pytest.raises(CheckpointError):
        _reshard_load(root)
    assert not marker.exists() and "ck.evil" not in sys.modules


# ---------------------------------------------------------------------------------- 2. layouts escaping


@pytest.mark.parametrize("bad_path", ["../outside.pt", "/ABS/outside.pt"])
def test_layout_read_back_may_not_leave_the_checkpoint(tmp_path: Path, bad_path: str) -> None:
    root, _value = _reshard_save(tmp_path)
    outside = tmp_path / "outside.pt"
    torch.save({"w": torch.full((4096,), 7.0)}, outside)
    path = bad_path.replace("/ABS", str(tmp_path))

    def craft(d: dict[str, Any]) -> None:
        d["metadata"]["model"]["rank_to_layout_info"]["0"] = {
            "file_path": path,
            "serialization_format": {"type": "TorchSerialization"},
        }

    _rewrite_metadata(root, craft)
    with pytest.raises(UnsafeCheckpointError, match=r"outside.pt"):
        _reshard_load(root)


# ---------------------------------------------------------------------------------- 3. symlinks, special files


def test_symlinked_item_file_is_refused_even_with_a_forged_record(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.zeros(8)})
    outside = tmp_path / "secret.pt"
    torch.save(torch.full((8,), 9.0), outside)
    (root / "model_0.pt").unlink()
    (root / "model_0.pt").symlink_to(outside)
    data = outside.read_bytes()

    def forge(d: dict[str, Any]) -> None:
        d["items"]["model"]["0"].update(size=len(data), crc32=zlib.crc32(data))
        d["items"]["model"]["0"].pop("blocks")  # a forger drops them: the whole-file CRC32 then matches

    _edit_manifest(root, forge)
    template = torch.zeros(8)
    with pytest.raises(UnsafeCheckpointError, match=r"model_0.pt.*symbolic link"):
        mgr.load(str(root), into={"model": template})
    assert torch.equal(template, torch.zeros(8))


def test_symlinked_item_file_is_refused_when_its_record_is_removed(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.zeros(8), "other": 1})
    outside = tmp_path / "secret.pt"
    torch.save(torch.full((8,), 9.0), outside)
    (root / "model_0.pt").unlink()
    (root / "model_0.pt").symlink_to(outside)
    _edit_manifest(root, lambda d: d["items"].pop("model"))
    # The loader itself (the manager's key check would answer first with a KeyError).
    template = torch.zeros(8)
    with pytest.raises(TemplateMismatchError, match=r"no item 'model'"):
        _loader().load(str(root), resolve({"model": template}, {}, ItemSpec(), 0))
    assert torch.equal(template, torch.zeros(8))


_FIFO_LOAD = """
import sys, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import CheckpointError
from torch_checkpointing.checkpoint_loader import CheckpointLoader
from torch_checkpointing.config import CheckpointLoaderConfig
from torch_checkpointing.schema import ItemSpec, resolve
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig
from torch_checkpointing.types import RankInfo
loader = CheckpointLoader(LocalFileSystemStorage(LocalFileSystemStorageConfig()), CheckpointLoaderConfig(),
                          RankInfo.single())
try:
    loader.load(sys.argv[1], resolve({"model": torch.zeros(8)}, {}, ItemSpec(), 0))
except CheckpointError as exc:
    print("REFUSED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("drop_record", [False, True])
def test_fifo_in_place_of_an_item_file_is_refused_without_hanging(
    tmp_path: Path, mgr: CheckpointManager, drop_record: bool
) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.zeros(8), "other": 1})
    (root / "model_0.pt").unlink()
    os.mkfifo(root / "model_0.pt")
    if drop_record:
        _edit_manifest(root, lambda d: d["items"].pop("model"))
    proc = subprocess.run(
        [sys.executable, "-c", _FIFO_LOAD, str(root)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED" in proc.stdout and "model" in proc.stdout


def test_unlisted_file_is_never_read(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.zeros(8)})
    torch.save(torch.ones(8), root / "extra_0.pt")  # dropped in later, listed nowhere
    with pytest.raises((TemplateMismatchError, KeyError), match=r"extra"):
        mgr.load(str(root), into={"model": torch.zeros(8), "extra": torch.zeros(8)})
    with pytest.raises(TemplateMismatchError, match=r"no item 'extra'"):
        _loader().load(str(root), resolve({"extra": None}, {}, ItemSpec(), 0))
    opt = _manager({"extra": ItemSpec(required=False)})
    try:
        out = opt.load(str(root), into={"model": torch.zeros(8), "extra": torch.zeros(8)})
        assert "extra" not in out
    finally:
        opt.close()


# ---------------------------------------------------------------------------------- 4. corruption, by default


def _flip_inside(path: Path, fmt: str) -> None:
    data = path.read_bytes()
    if fmt == "json":
        _flip(path, _offset_of(data, b"12345"))  # '1' -> '0': still valid JSON, different value
    elif fmt == "raw":
        _flip(path, len(data) // 2)
    else:  # tensor data sits near the end of both torch and safetensors files
        _flip(path, _offset_of(data, torch.full((64,), 3.0).numpy().tobytes()) + 17)


@pytest.mark.parametrize(
    ("fmt", "layout", "value", "template"),
    [
        ("torch", None, torch.full((64,), 3.0), torch.zeros(64)),
        (
            "safetensors",
            LayoutInfo("m.safetensors", SafetensorsSerialization()),
            {"w": torch.full((64,), 3.0)},
            {"w": torch.zeros(64)},
        ),
        ("json", LayoutInfo("m.json", JsonSerialization()), {"n": 12345}, None),
        ("raw", LayoutInfo("m.bin", RawSerialization()), bytes(range(200)), None),
    ],
)
def test_one_flipped_bit_is_refused_by_default(
    tmp_path: Path, fmt: str, layout: LayoutInfo | None, value: Any, template: Any
) -> None:
    m = _manager({"m": ItemSpec(layout=layout)})
    try:
        root = tmp_path / "ck"
        m.save(str(root), {"m": value})
        assert m.load(str(root), into={"m": template})["m"] is not None
        name = layout.file_path if layout is not None else "m_0.pt"
        _flip_inside(root / name, fmt)
        with pytest.raises(CorruptCheckpointError, match=rf"{name}.*CRC32"):
            m.load(str(root), into={"m": template})
    finally:
        m.close()


def test_verification_can_be_switched_off(tmp_path: Path) -> None:
    m = _manager({"m": ItemSpec(layout=LayoutInfo("m.bin", RawSerialization()))}, verify_checksums=False)
    try:
        m.save(str(tmp_path / "ck"), {"m": b"abcdef"})
        _flip(tmp_path / "ck" / "m.bin", 0)
        assert m.load(str(tmp_path / "ck"), into={"m": None})["m"] == b"`bcdef"
    finally:
        m.close()


def test_fast_checksum_equals_the_recorded_zlib_crc32() -> None:
    from torch_checkpointing.checksum import crc32

    data = os.urandom(3 * 1024 * 1024 + 7)
    assert crc32(memoryview(data)) == zlib.crc32(data)


# ---------------------------------------------------------------------------------- 5. resharded reads


@pytest.mark.parametrize("layout", [None, LayoutInfo("model_{rank}.safetensors", SafetensorsSerialization())])
def test_resharded_read_of_a_damaged_source_is_refused(tmp_path: Path, layout: LayoutInfo | None) -> None:
    root, value = _reshard_save(tmp_path, layout)
    _out, target = _reshard_load(root, layout)
    assert torch.equal(target, value)
    name = "model_0.pt" if layout is None else "model_0.safetensors"
    data = (root / name).read_bytes()
    _flip(root / name, _offset_of(data, torch.arange(100, 104, dtype=torch.float32).numpy().tobytes()) + 2)
    with pytest.raises(CorruptCheckpointError, match=rf"{name}.*CRC32"):
        _reshard_load(root, layout, verify_checksums=True)


# ---------------------------------------------------------------------------------- 6. shared files, rank 1


def test_shared_file_is_checked_on_every_rank(tmp_path: Path) -> None:
    layout = LayoutInfo("shared.json", JsonSerialization())
    m = _manager({"cfg": ItemSpec(layout=layout)})
    root = tmp_path / "ck"
    try:
        m.save(str(root), {"cfg": {"n": 12345}})
    finally:
        m.close()
    _edit_manifest(root, lambda d: d.update(world_size=2))  # as a 2-rank save leaves it: rank 0's record only
    _flip(root / "shared.json", _offset_of((root / "shared.json").read_bytes(), b"12345"))
    storage = LocalFileSystemStorage(LocalFileSystemStorageConfig())
    for rank in (0, 1):
        loader = CheckpointLoader(storage, CheckpointLoaderConfig(), RankInfo(rank, 2, rank, 2))
        items = resolve({"cfg": None}, {"cfg": ItemSpec(layout=layout)}, ItemSpec(), rank)
        with pytest.raises(CorruptCheckpointError, match=r"shared.json.*CRC32"):
            loader.load(str(root), items)


# ---------------------------------------------------------------------------------- 7. missing pieces


def test_deleted_metadata_named_by_the_manifest_is_refused(tmp_path: Path) -> None:
    root, _ = _reshard_save(tmp_path)
    (root / "metadata.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"metadata.json.*missing"):
        _reshard_load(root)


def test_listed_optional_item_whose_file_is_gone_is_refused(tmp_path: Path) -> None:
    m = _manager({"extra": ItemSpec(required=False)})
    try:
        root = tmp_path / "ck"
        m.save(str(root), {"model": torch.ones(2), "extra": torch.ones(2)})
        (root / "extra_0.pt").unlink()
        for strict in (False, True):
            with pytest.raises(CorruptCheckpointError, match=r"extra_0.pt.*missing"):
                m.load(str(root), into={"model": torch.zeros(2), "extra": torch.zeros(2)}, strict=strict)
    finally:
        m.close()


def test_verifying_without_a_manifest_refuses(tmp_path: Path) -> None:
    m = _manager(verify_checksums=True)
    try:
        m.save(str(tmp_path / "ck"), {"model": torch.ones(2)})
        (tmp_path / "ck" / "manifest.json").unlink()
        with pytest.raises(IncompleteCheckpointError, match=r"no manifest.json"):
            m.load(str(tmp_path / "ck"), into={"model": torch.zeros(2)})
    finally:
        m.close()


def test_manifest_less_directory_loads_by_default_with_a_warning_unless_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "legacy"
    root.mkdir()
    torch.save(torch.ones(2), root / "model_0.pt")
    m, strict_m = _manager(), _manager(allow_legacy_checkpoints=False)
    try:
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            assert torch.equal(m.load(str(root), into={"model": torch.zeros(2)})["model"], torch.ones(2))
        assert any("without a manifest" in r.getMessage() for r in caplog.records)
        with pytest.raises(IncompleteCheckpointError, match=r"no manifest.json"):
            strict_m.load(str(root), into={"model": torch.zeros(2)})
    finally:
        m.close()
        strict_m.close()


# ---------------------------------------------------------------------------------- 8. torn reads


_OVERWRITER = """
import sys, time, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
m = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))
deadline = time.time() + float(sys.argv[2])
tag = 0
while time.time() < deadline:
    tag += 1
    m.save(sys.argv[1], {"a": torch.full((4096,), float(tag)), "b": torch.full((4096,), float(tag))})
m.close()
"""


def test_load_during_an_overwrite_never_mixes_two_saves(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"a": torch.zeros(4096), "b": torch.zeros(4096)})
    writer = subprocess.Popen([sys.executable, "-c", _OVERWRITER, str(root), "12"], cwd=ROOT)
    loads = refused = 0
    try:
        deadline = time.time() + 30
        while writer.poll() is None and time.time() < deadline:
            a, b = torch.zeros(4096), torch.zeros(4096)
            try:
                mgr.load(str(root), into={"a": a, "b": b})
            except CheckpointError:
                refused += 1  # lost the race: refused as a whole, which a retry fixes
                continue
            loads += 1
            assert a[0] == a[-1] == b[0] == b[-1], f"torn load: a={a[0]}, b={b[0]} after {loads} loads"
    finally:
        writer.wait(timeout=60)
    assert writer.returncode == 0 and loads > 0
    a, b = torch.zeros(4096), torch.zeros(4096)
    mgr.load(str(root), into={"a": a, "b": b})  # the retry, once the writer has stopped
    assert a[0] == b[0] > 0


# ---------------------------------------------------------------------------------- 9. all or nothing


def test_failed_load_changes_nothing(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"a": torch.ones(256), "b": torch.ones(256)})
    with open(root / "b_0.pt", "r+b") as f:
        f.truncate(100)
    a, b = torch.zeros(256), torch.zeros(256)
    with pytest.raises(CorruptCheckpointError, match=r"b_0.pt"):
        mgr.load(str(root), into={"a": a, "b": b})
    assert torch.equal(a, torch.zeros(256)) and torch.equal(b, torch.zeros(256))


def test_template_mismatch_in_a_later_item_changes_nothing(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"a": torch.ones(4), "b": {"w": torch.ones(4)}})
    a = torch.zeros(4)
    with pytest.raises(TemplateMismatchError, match=r"b::w"):
        mgr.load(str(root), into={"a": a, "b": {"w": torch.zeros(5)}})
    assert torch.equal(a, torch.zeros(4))


# ---------------------------------------------------------------------------------- 10. partial restores


def test_non_strict_partial_restore_warns_naming_what_was_not_restored(
    tmp_path: Path, mgr: CheckpointManager, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": {"layer1": torch.ones(2)}})
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        mgr.load(str(root), into={"model": {"layer1": torch.zeros(2), "layer2": torch.zeros(2)}})
    assert any("model::layer2" in r.getMessage() for r in caplog.records)


def _adam() -> tuple[torch.nn.Linear, torch.optim.Adam]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.Adam(model.parameters())


def test_fresh_optimizer_template_gets_the_saved_moments(tmp_path: Path, mgr: CheckpointManager) -> None:
    model, opt = _adam()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    root = tmp_path / "ck"
    mgr.save(str(root), {"optim": opt.state_dict()})
    saved = opt.state_dict()["state"]
    _fresh_model, fresh = _adam()
    with pytest.raises(TemplateMismatchError, match=r"optim::state\.0"):
        mgr.load(str(root), into={"optim": fresh.state_dict()}, strict=True)
    out = mgr.load(str(root), into={"optim": fresh.state_dict()})
    fresh.load_state_dict(out["optim"])
    restored = fresh.state_dict()["state"]
    assert set(restored) == {0, 1}
    for i in (0, 1):
        assert torch.equal(restored[i]["exp_avg"], saved[i]["exp_avg"])


# ---------------------------------------------------------------------------------- 11. malformed files


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d.update(world_size=float("inf")), "world_size"),
        (lambda d: d.update(items=[]), "items"),
        (lambda d: d["items"]["model"]["0"].update(size="big"), "size"),
        (lambda d: d["items"]["model"]["0"].pop("crc32"), "crc32"),
        (lambda d: d.update(extra=json.loads("[" * 40 + "]" * 40)), "deeper"),
    ],
)
def test_malformed_manifest_raises_corrupt_naming_the_field(
    tmp_path: Path, mgr: CheckpointManager, edit: Callable[[dict[str, Any]], None], field: str
) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.ones(2)})
    _edit_manifest(root, edit)
    with pytest.raises(CorruptCheckpointError, match=rf"manifest.json.*{field}"):
        mgr.load(str(root), into={"model": torch.zeros(2)})


def test_an_overflowing_number_in_the_manifest_is_refused_naming_the_field(
    tmp_path: Path, mgr: CheckpointManager
) -> None:
    """JSON's `1e400` is no NaN/Infinity token, yet parses as infinity: refused like them (a commit time)."""
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.ones(2)})
    text = (root / "manifest.json").read_text()
    (root / "manifest.json").write_text(re.sub(r'"commit_time": [0-9.e+]+', '"commit_time": 1e400', text))
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json.*commit_time"):
        mgr.load(str(root), into={"model": torch.zeros(2)})


def test_deeply_nested_manifest_is_refused_without_recursion_error(tmp_path: Path, mgr: CheckpointManager) -> None:
    root = tmp_path / "ck"
    mgr.save(str(root), {"model": torch.ones(2)})
    (root / "manifest.json").write_text('{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json"):
        mgr.load(str(root), into={"model": torch.zeros(2)})


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(world_size="two"),
        lambda d: d["metadata"]["model"].update(rank_to_layout_info=[]),
        lambda d: d["metadata"]["model"]["nested_path_to_metadata"].update({"[Infinity]": []}),
        lambda d: d.update(
            metadata=[
                [
                    [
                        [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                                            []
                                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ]
                    ]
                ]
            ]
        ),
    ],
)
def test_malformed_metadata_raises_corrupt_naming_the_file(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    root, _ = _reshard_save(tmp_path)
    _rewrite_metadata(root, edit)
    with pytest.raises(CorruptCheckpointError, match=r"metadata.json"):
        _reshard_load(root)


# ---------------------------------------------------------------------------------- 12. JSON int keys


def test_json_item_with_int_keys_is_refused_at_save(tmp_path: Path) -> None:
    m = _manager({"cfg": ItemSpec(layout=LayoutInfo("cfg.json", JsonSerialization()))})
    try:
        with pytest.raises((TypeError, CheckpointError), match=r"cfg.*key 1 .*'a\.1'"):
            m.save(str(tmp_path / "ck"), {"cfg": {"a": {1: "x"}}})
        assert not (tmp_path / "ck").exists()
    finally:
        m.close()


def test_resharded_optimizer_state_gets_its_live_target_from_get_optimizer_state_dict(tmp_path: Path) -> None:
    """The supported way to a live target for resharded optimizer state (docs/durability.md, 'What a load checks')."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, opt = _adam()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    spec = {"optim": ItemSpec(resharder=AlwaysReshard())}
    m = _manager(spec)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.save(str(tmp_path / "ck"), {"optim": get_optimizer_state_dict(model, opt)})
            with pytest.raises(ValueError, match=r"live target"):
                m.load(str(tmp_path / "ck"), into={"optim": None})
            fresh_model, fresh = _adam()
            target = get_optimizer_state_dict(fresh_model, fresh)  # zero-initialised moments: the live target
            m.load(str(tmp_path / "ck"), into={"optim": target}, strict=True)
    finally:
        m.close()
    set_optimizer_state_dict(fresh_model, fresh, optim_state_dict=target)
    saved, restored = opt.state_dict()["state"], fresh.state_dict()["state"]
    for i in (0, 1):
        assert torch.equal(restored[i]["exp_avg"], saved[i]["exp_avg"])
        assert torch.equal(restored[i]["exp_avg_sq"], saved[i]["exp_avg_sq"])


class WholeFileResharder(Resharder):
    """A custom resharder that reads its source through the `storage` it is given (the design document's seam)."""

    def extract_sharding_metadata(self, item_key: str, item_value: Any) -> dict[Any, Any]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            return DTensorResharder().extract_sharding_metadata(item_key, item_value)

    def should_reshard(self, source_metadata: Any, target_metadata: Any) -> bool:
        return source_metadata is not None

    def load(
        self, source_path: Path, item_key: str, target_metadata: Any, source_metadata: Any, target: Any, storage: Any
    ) -> list[Any]:
        import io

        data = storage.read(source_metadata.get_file_path(0, source_path, item_key))
        self.fill(target, torch.load(io.BytesIO(data), weights_only=True))
        return []

    def fill(self, target: dict[str, Any], saved: dict[str, torch.Tensor]) -> None:
        """How `load` puts the file's tensors into the template (subclasses fill it other ways)."""
        target["w"].copy_(saved["w"])


def test_custom_resharder_reads_through_the_verifying_storage_view(tmp_path: Path) -> None:
    spec = {"model": ItemSpec(resharder=WholeFileResharder())}
    m = _manager(spec)
    try:
        m.save(str(tmp_path / "ck"), {"model": {"w": torch.arange(4096, dtype=torch.float32)}})
        target = torch.zeros(4096)
        m.load(str(tmp_path / "ck"), into={"model": {"w": target}})
        assert torch.equal(target, torch.arange(4096, dtype=torch.float32))
        path = tmp_path / "ck" / "model_0.pt"
        _flip(path, _offset_of(path.read_bytes(), torch.arange(100, 104, dtype=torch.float32).numpy().tobytes()) + 2)
        target = torch.zeros(4096)
        with pytest.raises(CorruptCheckpointError, match=r"model_0.pt.*CRC32"):
            m.load(str(tmp_path / "ck"), into={"model": {"w": target}})
        assert torch.equal(target, torch.zeros(4096))
    finally:
        m.close()


class _Custom:
    """A class torch's safe loader does not allow."""


def test_refused_pickle_is_an_unsafe_checkpoint_error_naming_the_file(tmp_path: Path) -> None:
    import pickle

    root = tmp_path / "ck"
    m = _manager()
    try:
        m.save(str(root), {"obj": {"x": _Custom()}})
        with pytest.raises(UnsafeCheckpointError, match=r"obj_0.pt") as info:
            m.load(str(root), into={"obj": None})
        assert isinstance(info.value, pickle.UnpicklingError)  # what callers caught before
    finally:
        m.close()


_FIFO_MANIFEST_PROGRAM = """
import os, sys, torch
from torch_checkpointing import CheckpointManager, UnsafeCheckpointError, list_checkpoints
root = sys.argv[1]
m = CheckpointManager(CheckpointManager.Config.with_sync_save())
m.save(root + "/c", {"model": {"w": torch.ones(3)}})
os.unlink(root + "/c/manifest.json")
os.mkfifo(root + "/c/manifest.json")
for what, call in [("load", lambda: m.load(root + "/c", into={"model": {"w": torch.zeros(3)}})),
                   ("list", lambda: list_checkpoints(root))]:
    try:
        print(what, "returned", call())
    except UnsafeCheckpointError as exc:
        print(what, "refused", exc)
m.close()
"""


def test_fifo_in_place_of_the_manifest_is_refused_without_hanging(tmp_path: Path) -> None:
    # Before: the manager's key check read manifest.json with a blocking open() outside the read context, and
    # every manifest reader (load, list_checkpoints, the CLI) hung forever on a FIFO.
    out = subprocess.run(
        [sys.executable, "-c", _FIFO_MANIFEST_PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "load refused" in out.stdout and "not a regular file" in out.stdout, out.stdout
    assert "list returned []" in out.stdout or "list refused" in out.stdout, out.stdout
