"""A new CheckpointManager built in a child made by os.fork() saves and loads there.

The parent's manager refuses to work in such a child and says to build a new one there. Before, that new
manager's writer died at every save once the parent had made an async save: the child inherited the parent's
multiprocessing resource sharer (its address and key counter), which hands the staging slab's descriptor to the
writer, so the child's writer asked the parent's sharer for a key the parent did not hold (the parent printed
`KeyError`) and the save failed with `WriterProcessDied`.
"""

from __future__ import annotations

from pathlib import Path

from tests.probes import run_script

_FORKED_NEW_MANAGER = """
import os, sys, time
import torch
from torch_checkpointing import CheckpointManager

if __name__ == "__main__":
    root = sys.argv[1]
    config = CheckpointManager.Config()
    config.save.wait_timeout_secs = 60
    manager = CheckpointManager(config)
    manager.save(f"{root}/parent_0", {"model": {"w": torch.ones(8)}}).result(120)  # its slab went to its writer
    in_flight = manager.save(f"{root}/parent_1", {"model": {"w": torch.full((8,), 2.0)}})
    child = os.fork()
    if child == 0:
        try:
            with CheckpointManager(config) as own:
                own.save(f"{root}/child_0", {"model": {"w": torch.full((8,), 5.0)}}).result(120)
                own.save(f"{root}/child_1", {"model": {"w": torch.full((8,), 6.0)}}).result(120)
                into = {"model": {"w": torch.zeros(8)}}
                own.load(f"{root}/parent_0", into)
                print(f"child loaded {into['model']['w'].tolist()}", flush=True)
            print("child: saved and loaded", flush=True)
        except BaseException as exc:
            print(f"child failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    print(f"parent in flight: {in_flight.result(120)}", flush=True)
    manager.save(f"{root}/parent_2", {"model": {"w": torch.full((8,), 3.0)}}).result(120)
    with CheckpointManager(config.with_sync_save()) as reader:
        for name, value in [("parent_1", 2.0), ("parent_2", 3.0), ("child_0", 5.0), ("child_1", 6.0)]:
            into = {"model": {"w": torch.zeros(8)}}
            reader.load(f"{root}/{name}", into)
            print(f"{name}: {into['model']['w'].tolist() == [value] * 8}", flush=True)
    manager.close()
    print("entries:", sorted(os.listdir(root)), flush=True)
"""


def test_a_manager_built_in_a_forked_child_saves_there_and_leaves_the_parents_writer_alone(tmp_path: Path) -> None:
    done = run_script(tmp_path / "forked_new_manager.py", _FORKED_NEW_MANAGER, str(tmp_path / "ckpt"), timeout=300)
    out = f"{done.stdout}\n{done.stderr}"
    assert "child: saved and loaded" in done.stdout, out
    assert "child loaded [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]" in done.stdout, out
    assert "parent in flight: None" in done.stdout, out
    for name in ("parent_1", "parent_2", "child_0", "child_1"):
        assert f"{name}: True" in done.stdout, out
    assert "entries: ['child_0', 'child_1', 'parent_0', 'parent_1', 'parent_2']" in done.stdout, out
    # the parent's resource sharer was asked for keys of the child's, and printed a traceback for each
    assert "KeyError" not in done.stderr and "Traceback" not in done.stderr, out
