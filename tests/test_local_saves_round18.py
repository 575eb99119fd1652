"""Round 18: what a failed local save leaves behind, and what its cleanup may remove.

Each test failed before its fix:

* an id with a component over NAME_MAX bytes (in the middle of the path), or whose temporary directory and item
  files would pass PATH_MAX, failed with a bare `OSError: [Errno 36] File name too long` after the save had
  created the id's missing parent directories, which stayed behind (sync and async alike);
* a save that failed for any other reason (here: its pre_finalize_callback raised) left the parent
  directories it had created.
* a failed save's cleanup removed its whole temporary directory, a file another program had put at one of
  its file names meanwhile with it;
* an async save over the file-size limit (RLIMIT_FSIZE) failed with torch's bare "unable to resize file
  </proc/self/fd/N>"; a sync one left the parents it had made;
* a parent directory that could not be made (EACCES under umask 0o277) left those made before it, and the
  error was a bare PermissionError naming neither the save nor the fix.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
from torch_checkpointing.errors import ConfigError
from torch_checkpointing.names import NAME_MAX

PATH_MAX = 4096
SUBPROCESS_S = 300  # importing torch on a loaded 2-core machine takes a while; a hang never ends
MODES = ["sync", "async"]


def _manager(mode: str, **config: Any) -> Any:
    make = CheckpointManager.Config.with_sync_save if mode == "sync" else CheckpointManager.Config.with_async_save
    cfg = make()
    for name, value in config.items():
        setattr(cfg, name, value)
    if mode == "async":
        cfg.save.wait_timeout_secs = 120
    return CheckpointManager(cfg)


def _save(manager: Any, checkpoint_id: str, state: dict[str, Any]) -> None:
    write = manager.save(checkpoint_id, state)
    if write is not None:
        write.result(120)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _id_of_length(root: Path, size: int) -> str:
    """An absolute id of exactly `size` bytes under `root`: 200-byte directories, then `step_<padding>`."""
    left = size - len(os.fsencode(str(root)))
    parts = []
    while left > 201 + 1 + 20:
        parts.append("d" * 200)
        left -= 201
    parts.append("step_" + "1" * (left - 1 - 5))
    checkpoint_id = str(root) + "/" + "/".join(parts)
    assert len(os.fsencode(checkpoint_id)) == size
    return checkpoint_id


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.ones(4)}, "extra": {"n": 1}}


@pytest.fixture(scope="module", params=MODES)
def manager(request: pytest.FixtureRequest) -> Any:
    with _manager(request.param) as m:
        yield m


# ------------------------------------------------------------------------ ids too long for the filesystem


@pytest.mark.parametrize(
    "where", ["middle", "first", "after_parent"], ids=["component-in-the-middle", "first-new", "last-parent"]
)
def test_an_id_with_a_component_over_name_max_is_refused_and_creates_nothing(
    tmp_path: Path, manager: Any, where: str
) -> None:
    long = "x" * (NAME_MAX + 1)
    rel = {"middle": f"a/b/{long}/c/step_1", "first": f"{long}/step_1", "after_parent": f"a/{long}/step_1"}[where]
    (tmp_path / "keep").mkdir()
    with pytest.raises(ConfigError, match=r"256 bytes.*255-byte limit.*shorter") as info:
        _save(manager, str(tmp_path / rel), _state())
    assert long[:40] in str(info.value)
    assert _tree(tmp_path) == ["keep"]


def test_an_id_whose_files_would_pass_path_max_is_refused_and_creates_nothing(tmp_path: Path, manager: Any) -> None:
    # The id itself fits PATH_MAX; its temporary name and the item files under it do not.
    with pytest.raises(ConfigError, match=r"PATH_MAX") as info:
        _save(manager, _id_of_length(tmp_path, PATH_MAX - 10), _state())
    assert "shorter" in str(info.value)
    assert _tree(tmp_path) == []


def test_a_rank_layout_under_a_long_id_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    spec = ItemSpec(layout=LayoutInfo("rank_{rank}/" + "f" * 250 + "/model.pt", TorchSerialization()))
    # The id and its temporary name fit with room to spare; the item's file under it does not.
    with _manager("sync", items={"model": spec}) as m, pytest.raises(ConfigError, match="PATH_MAX") as info:
        _save(m, _id_of_length(tmp_path, PATH_MAX - 200), _state())
    assert "model.pt" in str(info.value)
    assert _tree(tmp_path) == []


# ------------------------------------------------------------------ a failed save removes the parents it made


def _refuse_commit(checkpoint_id: str, _: Any) -> None:
    raise RuntimeError(f"refusing {checkpoint_id}")


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
@pytest.mark.parametrize("mode", MODES)
def test_a_failed_save_removes_the_parent_directories_it_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, relative: bool
) -> None:
    # Fails after every file was written (a pre_finalize_callback that raises): its temporary directory went,
    # the parents `a/b/` it had made for the id stayed.
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "old.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    rank_layout = ItemSpec(layout=LayoutInfo("rank_{rank}/model.pt", TorchSerialization()))
    with _manager(mode, pre_finalize_callback=_refuse_commit, items={"model": rank_layout}) as m:
        for rel in ("a/b/step_1", "keep/new/step_1", "keep/step_1"):
            with pytest.raises(Exception, match="refusing"):
                _save(m, rel if relative else str(tmp_path / rel), _state())
            assert _tree(tmp_path) == ["keep", "keep/old.txt"], rel


# ----------------------------------------------------- a failed save's cleanup removes only what it created


def _replace_a_file_then_refuse(checkpoint_id: str, _: Any) -> None:
    """Another program replaces one of the save's files (same name, another inode and size), then the save fails."""
    final = Path(checkpoint_id)
    (tmp,) = final.parent.glob(f".{final.name}.tmp-*")
    theirs = tmp / "rank_0" / "model.pt"
    (tmp / "theirs.partial").write_bytes(b"their bytes")
    os.replace(tmp / "theirs.partial", theirs)
    raise RuntimeError(f"refusing {checkpoint_id}")


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_saves_cleanup_leaves_a_file_replaced_meanwhile(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before: the discard removed the whole temporary directory, the other program's file with it.
    rank_layout = ItemSpec(layout=LayoutInfo("rank_{rank}/model.pt", TorchSerialization()))
    config = {"pre_finalize_callback": _replace_a_file_then_refuse, "items": {"model": rank_layout}}
    level = caplog.at_level(logging.WARNING, logger="torch_checkpointing")
    with level, _manager(mode, **config) as m, pytest.raises(Exception, match="refusing"):
        _save(m, str(tmp_path / "step_1"), _state())
    (tmp,) = tmp_path.glob(".step_1.tmp-*")  # kept, with its marker: gc still knows it as a dead save's
    left = {str(p.relative_to(tmp)): p.read_bytes() for p in tmp.rglob("*") if p.is_file()}
    assert left == {"rank_0/model.pt": b"their bytes", ".incomplete": b""}
    assert sorted(p.name for p in tmp_path.iterdir()) == [tmp.name]
    if mode == "sync":  # (the async writer logs in its own process)
        said = [r for r in caplog.records if r.levelno == logging.WARNING and "model.pt" in r.getMessage()]
        assert said, caplog.text
        assert "not created by this save" in said[0].getMessage()


# ------------------------------------------------------------------------ a file-size limit (RLIMIT_FSIZE)

_FSIZE_JOB = """
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
mode, base = sys.argv[1], sys.argv[2]
make = CheckpointManager.Config.with_sync_save if mode == "sync" else CheckpointManager.Config.with_async_save
with CheckpointManager(make()) as m:
    try:
        write = m.save(os.path.join(base, "a", "b", "step_1"), {"model": {"w": torch.ones(1 << 20)}})
        if write is not None:
            write.result(120)
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_save_over_the_file_size_limit_says_so_and_leaves_nothing(tmp_path: Path, mode: str) -> None:
    # Before: sync left the parents `a/b/` it had made; async failed in its staging with torch's bare
    # "RuntimeError: unable to resize file </proc/self/fd/5> to the right size: File too large (27)".
    base = tmp_path / "base"
    base.mkdir()
    run = subprocess.run(
        [sys.executable, "-c", _FSIZE_JOB, mode, str(base)], capture_output=True, text=True, timeout=SUBPROCESS_S
    )
    assert run.returncode == 0, run.stderr
    said = next(line for line in run.stdout.splitlines() if line.startswith("RAISED"))
    assert said.startswith("RAISED OSError") and "[Errno 27]" in said and "RLIMIT_FSIZE" in said, said
    assert _tree(base) == []


# ------------------------------------------------------- a parent that cannot be made, after others were

_UMASK_JOB = """
import os, sys, torch
from torch_checkpointing import CheckpointManager
mode, base, warm = sys.argv[1], sys.argv[2], sys.argv[3]
make = CheckpointManager.Config.with_sync_save if mode == "sync" else CheckpointManager.Config.with_async_save
with CheckpointManager(make()) as m:
    write = m.save(warm, {"model": {"w": torch.ones(4)}})  # the async writer is up (it stays root)
    if write is not None:
        write.result(120)
    if os.geteuid() == 0:  # root writes into any directory: the refusal needs an ordinary user
        os.setgid(65534)
        os.setuid(65534)
    os.umask(0o277)  # new directories are made read-only (r-x) for their owner too
    try:
        write = m.save(os.path.join(base, "a", "b", "step_1"), {"model": {"w": torch.ones(4)}})
        if write is not None:
            write.result(120)
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc)
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_parent_that_cannot_be_made_leaves_none_of_those_made_before_it(tmp_path: Path, mode: str) -> None:
    # Under umask 0o277 the save makes `a/` (r-x), then cannot make `a/b/` in it (EACCES). Before: `a/` stayed.
    base = Path(tempfile.mkdtemp(prefix="round18-umask-"))  # under /tmp: an ordinary user can reach it
    try:
        base.chmod(0o777)
        run = subprocess.run(
            [sys.executable, "-c", _UMASK_JOB, mode, str(base), str(tmp_path / "warm")],
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_S,
        )
        assert run.returncode == 0, run.stderr
        said = next(line for line in run.stdout.splitlines() if line.startswith("RAISED"))
        assert "PermissionError [Errno 13]" in said and "a/b" in said, said
        assert "step_1 was not committed" in said and "check the owner and mode" in said, said
        assert _tree(base) == []
    finally:
        for path in base.rglob("*"):
            if path.is_dir():
                path.chmod(0o700)
        shutil.rmtree(base)


def _move_the_temporary_away_then_refuse(checkpoint_id: str, _: Any) -> None:
    """Another program moves the save's directory into a folder of its own and leaves a link in its place."""
    final = Path(checkpoint_id)
    (tmp,) = final.parent.glob(f".{final.name}.tmp-*")
    theirs = final.parent / "theirs"
    os.rename(tmp, theirs)
    (theirs / "notes.txt").write_text("mine")
    tmp.symlink_to(theirs)
    raise RuntimeError(f"refusing {checkpoint_id}")


def test_a_failed_saves_cleanup_never_follows_a_link_put_at_its_directory(tmp_path: Path) -> None:
    # The save's own files, moved into the other program's folder, are that program's now: nothing is removed
    # through the link (its cleanup walked the folder the link pointed to and removed them).
    refuse = _move_the_temporary_away_then_refuse
    with _manager("sync", pre_finalize_callback=refuse) as m, pytest.raises(Exception, match="refusing"):
        _save(m, str(tmp_path / "step_1"), _state())
    left = _tree(tmp_path / "theirs")
    assert "notes.txt" in left and any(name.endswith(".pt") for name in left), left


def _fill_the_id_then_go_on(checkpoint_id: str, _: Any) -> None:
    """Another program makes the id a folder of its own while the save writes: the commit then refuses it."""
    Path(checkpoint_id).mkdir()
    (Path(checkpoint_id) / "notes.txt").write_text("mine")


@pytest.mark.filterwarnings("ignore:Item 'model' has plain:UserWarning")  # the resharder's note on plain tensors
def test_a_save_refused_at_its_commit_leaves_no_metadata_behind(tmp_path: Path) -> None:
    # With a resharder the save writes metadata.json beside the manifest; refused after that (the id became a
    # folder of another program's), its cleanup took metadata.json for another program's file and kept the
    # whole temporary directory.
    from torch_checkpointing.dtensor_resharder import DTensorResharder
    from torch_checkpointing.errors import CommitError

    config = {
        "pre_finalize_callback": _fill_the_id_then_go_on,
        "items": {"model": ItemSpec(resharder=DTensorResharder())},
    }
    with _manager("sync", **config) as m, pytest.raises(CommitError, match="not a checkpoint"):
        _save(m, str(tmp_path / "step_1"), _state())
    assert _tree(tmp_path) == ["step_1", "step_1/notes.txt"]


# ------------------------------------------------------------------------------------- on real gloo ranks


@pytest.mark.multirank
def test_a_multi_rank_save_failed_on_one_rank_removes_the_parents_rank_0_made(tmp_path: Path) -> None:
    from simulator.launcher import launch
    from tests import local_saves_round18_jobs

    for mode in MODES:
        (tmp_path / mode).mkdir()
    results = launch(local_saves_round18_jobs.failed_save_into_new_parents, 2, args=(str(tmp_path),), timeout=240)
    for r in results:
        for mode in MODES:
            assert "rank 1 refuses" in r[mode], r
            assert r[f"{mode}_left"] == ["async", "sync"], r
