"""Promises of the user-facing docs (docs/operations.md, docs/storage.md) held to by tests, one table per doc
where the cases share a shape, each run against real files and the real public calls.

Each failed before round 31: `collect_garbage(root)` (the Python call docs/operations.md pairs with
`torch-checkpointing gc`) took a root that is a file for an empty run and a checkpoint passed for its run's root
for one with nothing to collect, saying nothing (only the CLI's `gc` kept those promises); a listing of a URL
root that is an object named it `memory:/...` (storage.md: by its URL); and a load read the whole
/proc/self/maps once per Torch file it mapped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.cli import main
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, collect_garbage, prune


def _save_run(root: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in steps:
            manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((2,), float(step))}}, step=step)


# Every listing, retention and gc call of docs/operations.md ("Wrong roots are said, not taken for a first run").
ROOT_CALLS: dict[str, Callable[[Path], Any]] = {
    "list_checkpoints": list_checkpoints,
    "latest_checkpoint": latest_checkpoint,
    "prune": lambda root: prune(root, RetentionPolicy(keep_last=1)),
    "prune(dry_run)": lambda root: prune(root, RetentionPolicy(keep_last=1), dry_run=True),
    "collect_garbage": collect_garbage,
    "collect_garbage(dry_run)": lambda root: collect_garbage(root, dry_run=True),
}


@pytest.mark.parametrize("call", sorted(ROOT_CALLS))
def test_a_root_that_is_a_file_is_refused_naming_it(tmp_path: Path, call: str) -> None:
    """operations.md: "A root that is a file raises `NotADirectoryError` naming it" (a resume, or a cleanup
    script, that took "nothing there" for a first run would start over, or never clean)."""
    root = tmp_path / "run.txt"
    root.write_text("not a run\n")
    with pytest.raises(NotADirectoryError, match=f"{root}.* is a file, not a directory: pass the directory"):
        ROOT_CALLS[call](root)
    assert root.read_text() == "not a run\n"


@pytest.mark.parametrize("call", sorted(ROOT_CALLS))
def test_a_checkpoint_passed_for_its_root_is_said_naming_the_parent(
    tmp_path: Path, call: str, caplog: pytest.LogCaptureFixture
) -> None:
    """operations.md: a root that is itself a checkpoint "lists nothing with a WARNING naming the parent to pass
    (`gc` of one, which finds nothing to collect there, warns the same)"; and nothing under it is touched."""
    run = tmp_path / "run"
    _save_run(run)
    before = sorted(p.name for p in (run / "step_2").iterdir())
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        ROOT_CALLS[call](run / "step_2")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("is itself a checkpoint" in m and f"pass its parent directory {run}" in m for m in said), said
    assert len(said) == 1, said  # said once, not once per layer
    assert sorted(p.name for p in (run / "step_2").iterdir()) == before
    assert [c.name for c in list_checkpoints(run)] == ["step_1", "step_2"]


@pytest.mark.parametrize("command", ["ls", "gc"])
def test_the_cli_says_a_checkpoint_root_once(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """The CLI's `ls` and `gc` of a checkpoint say it once (the listing and gc under them both look)."""
    run = tmp_path / "run"
    _save_run(run)
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        assert main([command, str(run / "step_2")]) == 0
    said = [r.getMessage() for r in caplog.records if "is itself a checkpoint" in r.getMessage()]
    assert len(said) == 1, said


@pytest.mark.parametrize("call", sorted(ROOT_CALLS))
def test_a_url_root_that_is_a_file_is_named_by_its_url(call: str) -> None:
    """storage.md: messages name a checkpoint by the full URL that `load` and the CLI take (a listing's too);
    a `memory://` root that is an object was named `memory:/root/...`, which no call takes."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    fs.pipe("/doc_promises_round31/run.txt", b"not a run\n")
    try:
        with pytest.raises(NotADirectoryError) as raised:
            ROOT_CALLS[call]("memory://doc_promises_round31/run.txt")
        assert str(raised.value).startswith("memory://doc_promises_round31/run.txt is a file"), raised.value
        assert fs.cat("/doc_promises_round31/run.txt") == b"not a run\n"
    finally:
        fs.rm("/doc_promises_round31", recursive=True)


# ------------------------------------------------------------------------------ where a Torch file is mapped

_COUNT_MAPS_READS = """
import builtins, json, mmap, os, sys
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

root, files = sys.argv[1], int(sys.argv[2])
config = CheckpointManager.Config(save=SyncCheckpointSaverConfig())
with CheckpointManager(config) as manager:
    manager.save(root, {f"item{i}": {"w": torch.full((16,), float(i))} for i in range(files)})
    with open(os.path.join(root, "item0_0.pt"), "rb") as probe:  # can this process name a mapping of its own?
        held = mmap.mmap(probe.fileno(), 0, prot=mmap.PROT_READ)
        lo = int(next(line.split(b"-")[0] for line in open("/proc/self/maps", "rb")
                      if line.rstrip().endswith(b"item0_0.pt")), 16)
        named = os.path.exists(f"/proc/self/map_files/{lo:x}-{lo + mmap.PAGESIZE * -(-len(held) // mmap.PAGESIZE):x}")
        held.close()
    opened = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == "/proc/self/maps":
            opened.append(file)
        return real_open(file, *args, **kwargs)

    builtins.open = counting_open
    try:
        held_values = [manager.load(root), manager.load(root)]  # the first load's mappings live on, as in `diff`
    finally:
        builtins.open = real_open
    values_ok = all(
        torch.equal(v[f"item{i}"]["w"], torch.full((16,), float(i))) for v in held_values for i in range(files)
    )
    # The base found by name is the one the whole map gives (records: offset -> size, as the check walks them).
    from torch_checkpointing import codecs

    path = os.path.join(root, "item0_0.pt")
    with open(path, "rb") as file:
        records = codecs.tensor_records(file)
    loaded = torch.load(path, mmap=True, weights_only=True)
    pointer, st = loaded["w"].untyped_storage().data_ptr(), os.stat(path)
    bases = [codecs.file_base_address(pointer, st, records), codecs.file_base_address(pointer, st)]
print("RESULT", json.dumps({"named": named, "opened": len(opened), "values_ok": values_ok, "bases": bases}))
"""


def test_a_load_finds_each_mapped_file_without_reading_the_whole_process_map(tmp_path: Path) -> None:
    """Each Torch file a load maps is checked against its records, which needs where torch mapped it. That was
    one read of /proc/self/maps per file, whose cost grows with every mapping alive: a load of 1,000 small
    files while an earlier load's 1,000 mappings lived spent 2.3 s of its 3.4 s there. The mapping is now named
    directly (/proc/self/map_files) from the file's own record offsets; the whole map is the fallback."""
    import subprocess
    import sys

    files = 40
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_MAPS_READS, str(tmp_path / "ck"), str(files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    assert result["values_ok"], result
    assert result["bases"][1] is not None and result["bases"][0] == result["bases"][1], result
    if not result["named"]:
        pytest.skip("this kernel does not name a process's mappings under /proc/self/map_files: the map is read")
    assert result["opened"] == 0, result  # before: 2 * files
