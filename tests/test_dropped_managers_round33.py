"""The autouse check of tests/dropped_managers.py: a test that drops a CheckpointManager without close() fails at
its teardown; one that closes it, or uses a module-scoped manager, or drops one on purpose saying so with the
marker, passes.

Before it, a manager one test dropped in a reference cycle was collected at a later test's garbage collection,
and its "was dropped without close()" WARNING failed that later test's log assertions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TESTS = """
import gc
import pytest
from torch_checkpointing import CheckpointManager
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

def _manager(tmp_path):
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)

@pytest.fixture(scope="module")
def shared():
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        yield manager

def test_uses_a_module_scoped_manager(shared):
    assert shared is not None

def test_uses_it_again(shared):
    assert shared is not None

def test_closes_it(tmp_path):
    _manager(tmp_path).close()

def test_closes_it_in_with(tmp_path):
    with _manager(tmp_path):
        pass

def test_drops_it(tmp_path):
    _manager(tmp_path)

class Holder:
    pass

def test_drops_it_in_a_cycle(tmp_path):
    holder = Holder()
    holder.manager, holder.me = _manager(tmp_path), holder

def test_drops_it_while_failing(tmp_path):
    manager = _manager(tmp_path)
    assert manager is None, "the test's own failure"

@pytest.mark.drops_manager
def test_drops_it_on_purpose(tmp_path):
    holder = Holder()
    holder.manager, holder.me = _manager(tmp_path), holder

def test_after_them():
    gc.collect()
"""

PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.dropped_managers", "-q", "-rE"]


def test_a_dropped_manager_fails_its_own_test_and_a_closed_one_passes(tmp_path: Path) -> None:
    (tmp_path / "test_drops.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [*PYTEST, "--rootdir", str(tmp_path), str(tmp_path / "test_drops.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout
    said = {block.split(" ", 1)[0]: block for block in out.split("ERROR at teardown of ")[1:]}
    assert sorted(said) == ["test_drops_it", "test_drops_it_in_a_cycle"], out[-4000:]
    for block in said.values():
        assert "dropped 1 CheckpointManager(s) without close()" in block, block[-1500:]
    # A failed test's traceback keeps its manager alive past its teardown: collected later, it is named then.
    later = "a CheckpointManager built by test_drops.py::test_drops_it_while_failing was dropped without close()"
    assert later in out, out[-4000:]
    assert "1 failed, 8 passed, 1 warning, 2 errors" in out, out[-4000:]
