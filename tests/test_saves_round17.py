"""Round 17: saves that must not lose data, delete what is not theirs, hang, or fail silently."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing.errors import CommitError

# ------------------------------------------------------------------ a save() made from inside a save()

_NESTED = textwrap.dedent(
    """
    import os, sys, torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.errors import CheckpointError

    if __name__ == "__main__":
        root, which = sys.argv[1], sys.argv[2]
        config = CheckpointManager.Config.with_sync_save()
        seen = []

        def callback(checkpoint_id, _):
            try:
                manager.save(f"{root}/inner", {"model": {"w": torch.zeros(2)}})
                seen.append("returned")
            except CheckpointError as exc:
                seen.append(str(exc))

        setattr(config, which, callback)
        manager = CheckpointManager(config)
        manager.save(f"{root}/outer", {"model": {"w": torch.ones(2)}})
        manager.config.pre_finalize_callback = manager.config.finalize_callback = None
        manager.save(f"{root}/after", {"model": {"w": torch.full((2,), 3.0)}})  # the manager still saves
        manager.close()
        print("RESULT", seen, sorted(os.listdir(root)), flush=True)
    """
)


@pytest.mark.parametrize("which", ["finalize_callback", "pre_finalize_callback"])
def test_a_save_from_a_save_callback_is_refused_instead_of_hanging(tmp_path: Path, which: str) -> None:
    # Before: the callback's save() waited for the save that called the callback, which waited for the callback:
    # the process hung for good (no timeout applies to that lock).
    script = tmp_path / "nested.py"
    script.write_text(_NESTED)
    root = tmp_path / "run"
    root.mkdir()
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(root), which], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a save() from the {which} hung: {exc.stdout!r} {exc.stderr!r}")
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT"))
    assert "'after', 'outer']" in line and "inner" not in line.split("]")[-2], line
    assert "from inside the save of" in line and "outer" in line and "Save it after" in line, line


# ------------------------------------------------------------------ the working directory is never replaced


def _manager(mode: str) -> Any:
    from torch_checkpointing import CheckpointManager

    config = CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
    config.save.wait_timeout_secs = 60
    return CheckpointManager(config)


def _save(manager: Any, checkpoint_id: str, value: float) -> None:
    write = manager.save(checkpoint_id, {"model": {"w": torch.full((4,), value)}})
    if write is not None:
        write.result(60)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("where", ["checkpoint", "empty", "inside"])
def test_a_save_never_replaces_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, where: str
) -> None:
    # Before: a checkpoint of ours (or an empty folder) that was the working directory, or held it in an empty
    # folder no listing counts as a file, was replaced: the program's directory was deleted under it, and every
    # relative path (a relative save id included: a bare FileNotFoundError) failed after.
    target = tmp_path / "ck"
    manager = _manager(mode)
    try:
        if where == "empty":
            target.mkdir()
            cwd = target
        else:
            _save(manager, str(target), 1.0)
            cwd = target / "scratch" if where == "inside" else target
            cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        # An empty folder inside a checkpoint is not part of it (round 32): refused as such before the cwd check.
        said = r"not part of it \(scratch/\)" if where == "inside" else r"working directory of this process.*os\.chdir"
        with pytest.raises(CommitError, match=said):
            _save(manager, str(target), 2.0)
        assert os.path.samefile(os.getcwd(), cwd)  # still there, not a deleted inode
        monkeypatch.chdir(tmp_path)
        if where != "empty":
            out = manager.load(str(target), into={"model": {"w": torch.zeros(4)}})
            assert torch.equal(out["model"]["w"], torch.full((4,), 1.0))
        if where == "inside":
            cwd.rmdir()  # the user's folder, which the replace would delete
        _save(manager, str(target), 3.0)  # out of it, the id is saved as before
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ------------------------------------------------------------------ a value whose own pickling raises anything


class _RaisesOnPickle:
    """A value whose __reduce__ raises its own exception type (a handle that refuses to be serialised)."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error

    def __reduce__(self) -> Any:
        raise self.error("this handle cannot be serialised")


class _CopiesButRaisesOnPickle(_RaisesOnPickle):
    """Deep-copied fine (the async staging copy), refused only when pickled for the writer process."""

    def __deepcopy__(self, memo: Any) -> Any:
        return _CopiesButRaisesOnPickle(self.error)


@pytest.mark.parametrize("mode", ["sync", "async", "async-copies", "async-no-copy"])
@pytest.mark.parametrize("error", [RuntimeError, ValueError, OSError])
def test_a_value_whose_pickling_raises_its_own_error_is_named(tmp_path: Path, mode: str, error: type) -> None:
    # Before: only PicklingError/TypeError/AttributeError/... were taken for a value that cannot be saved; a
    # RuntimeError, ValueError or OSError raised by a value's own __reduce__ came out bare, naming neither the
    # item nor the leaf nor the fix (and an async save's was not even a PicklingError).
    import pickle

    from torch_checkpointing import CheckpointManager, ItemSpec

    config = CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
    if mode == "async-no-copy":
        config.default = ItemSpec(requires_copy=False)
    bad = (_CopiesButRaisesOnPickle if mode == "async-copies" else _RaisesOnPickle)(error)
    target = tmp_path / "ck"
    manager = CheckpointManager(config)
    try:
        _save(manager, str(target), 1.0)
        with pytest.raises(pickle.PicklingError, match=r"'model::b\.1'.*this handle cannot be serialised") as info:
            write = manager.save(str(target), {"model": {"w": torch.ones(4), "b": [1, bad]}})
            if write is not None:
                write.result(60)
        assert isinstance(info.value.__cause__, error)
        out = manager.load(str(target), into={"model": {"w": torch.zeros(4)}})
        assert torch.equal(out["model"]["w"], torch.full((4,), 1.0))  # the earlier checkpoint is intact
        _save(manager, str(target), 2.0)  # and the manager saves on
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ------------------------------------------------------------------ a layout path that names a folder


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("path", ["x.pt/.", "sub/x_{rank}.pt/."])
def test_a_layout_path_ending_in_slash_dot_is_refused_naming_the_item(tmp_path: Path, mode: str, path: str) -> None:
    # Before: normpath('x.pt/.') is 'x.pt', so the layout check passed, but the writer opened 'x.pt/.' as given:
    # the save failed mid-write with a bare IsADirectoryError naming no item.
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, TorchSerialization
    from torch_checkpointing.errors import ConfigError

    config = CheckpointManager.Config.with_sync_save() if mode == "sync" else CheckpointManager.Config.with_async_save()
    config.items = {"model": ItemSpec(layout=LayoutInfo(path, TorchSerialization()))}
    manager = CheckpointManager(config)
    try:
        with pytest.raises(ConfigError, match=r"for key 'model' must name a file.*trailing '/\.'"):
            _save(manager, str(tmp_path / "ck"), 1.0)
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_relative_id_after_the_working_directory_was_deleted_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Before: save("ck") and load("ck") raised a bare "[Errno 2] No such file or directory" from os.path.abspath
    # deep in the target check, naming neither the id nor why.
    gone = tmp_path / "gone"
    gone.mkdir()
    manager = _manager(mode)
    try:
        # The async writer is spawned in the background and takes the working directory it is spawned in: one
        # spawned after the chdir below (a slow machine) could not start there. Its first save waits for it.
        _save(manager, str(tmp_path / "warm"), 0.0)
        monkeypatch.chdir(gone)
        gone.rmdir()
        for call in (lambda: _save(manager, "ck", 1.0), lambda: manager.load("ck")):
            with pytest.raises(FileNotFoundError, match=r"'ck' is relative, but the working directory.*absolute id"):
                call()
        monkeypatch.chdir(tmp_path)
        _save(manager, "ck", 2.0)  # the manager works on once there is a working directory again
    finally:
        manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "warm"]


_EMERGENCY = textwrap.dedent(
    """
    import os, signal, sys, torch
    from torch_checkpointing import CheckpointManager

    if __name__ == "__main__":
        root = sys.argv[1]
        config = CheckpointManager.Config.with_sync_save()
        config.pre_finalize_callback = lambda checkpoint_id, _: os.kill(os.getpid(), signal.SIGTERM)

        def preempted(signum, frame):  # the usual preemption handler: an emergency save, then exit
            try:
                manager.save(f"{root}/emergency", {"model": {"w": torch.zeros(2)}})
                print("EMERGENCY saved", flush=True)
            except Exception as exc:
                print("EMERGENCY", type(exc).__name__, str(exc), flush=True)
            sys.exit(143)

        signal.signal(signal.SIGTERM, preempted)
        manager = CheckpointManager(config)
        try:
            manager.save(f"{root}/step_1", {"model": {"w": torch.ones(2)}})
        finally:
            print("LEFT", sorted(os.listdir(root)), flush=True)
    """
)


def test_an_emergency_save_in_a_sigterm_handler_during_a_sync_save_does_not_hang(tmp_path: Path) -> None:
    # Before: SIGTERM landing inside a sync save ran the handler on the saving thread; its save() waited for the
    # save it interrupted: the preempted job hung until SIGKILL, exiting with neither checkpoint.
    script = tmp_path / "emergency.py"
    script.write_text(_EMERGENCY)
    root = tmp_path / "run"
    root.mkdir()
    try:
        run = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the emergency save hung: {exc.stdout!r} {exc.stderr!r}")
    assert run.returncode == 143, run.stdout + run.stderr
    assert "EMERGENCY CheckpointError" in run.stdout and "from inside the save of" in run.stdout, run.stdout
    assert "LEFT []" in run.stdout, run.stdout  # the interrupted save committed nothing, and left nothing


def test_the_async_writers_own_start_directory_is_no_reason_to_refuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The writer process keeps the directory the manager was built in; only the program's working directory
    # protects a target. A job built in an empty run/ that then changed directory saves to run/.
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(run)
    manager = _manager("async")
    try:
        _save(manager, str(tmp_path / "warm"), 0.0)  # the writer is up, started in run/
        monkeypatch.chdir(tmp_path)
        _save(manager, str(run), 1.0)
        out = manager.load(str(run), into={"model": {"w": torch.zeros(4)}})
    finally:
        manager.close()
    assert torch.equal(out["model"]["w"], torch.full((4,), 1.0))


_KILLED_WHILE_THE_WRITER_STARTS = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from torch_checkpointing import CheckpointManager

    if __name__ == "__main__":
        manager = CheckpointManager(CheckpointManager.Config.with_async_save())
        time.sleep(float(sys.argv[2]))  # the writer is importing torch: its death signal is not armed yet
        print("WRITER STARTING", flush=True)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    """
)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("after", ["0.5", "0.9"])
def test_a_job_killed_while_its_writer_starts_gets_no_writer_traceback(tmp_path: Path, sig: str, after: str) -> None:
    # Before: the writer, still starting, sent its Ready to a trainer that was gone and printed a BrokenPipeError
    # traceback under "Process ckpt-writer", as if the writer had failed; it now ends quietly, as on EOF.
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_WHILE_THE_WRITER_STARTS)
    run = subprocess.run([sys.executable, str(script), sig, after], capture_output=True, text=True, timeout=120)
    # The writer holds the captured stderr until it has ended: by now it has answered, or ended without a word.
    assert run.returncode == -getattr(__import__("signal"), sig), run.stdout + run.stderr
    assert "WRITER STARTING" in run.stdout, run.stdout + run.stderr
    # (A kill before the spawned child has read its start-up data makes multiprocessing's own bootstrap print a
    # traceback: that is the standard library's, before any of the writer's code runs.)
    assert "Process ckpt-writer" not in run.stderr and "BrokenPipeError" not in run.stderr, run.stderr


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_id_holding_a_nul_character_is_refused_naming_it(tmp_path: Path, mode: str) -> None:
    # Before: save() and load() failed with a bare ValueError "embedded null byte" naming neither the id nor the fix.
    from torch_checkpointing.errors import ConfigError

    manager = _manager(mode)
    try:
        for call in (lambda: _save(manager, f"{tmp_path}/a\x00b", 1.0), lambda: manager.load(f"{tmp_path}/a\x00b")):
            with pytest.raises(ConfigError, match=r"Checkpoint id '.*a\\x00b' holds a NUL character"):
                call()
    finally:
        manager.close()
    assert list(tmp_path.iterdir()) == []
