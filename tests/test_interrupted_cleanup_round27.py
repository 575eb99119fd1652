"""A sync save's clean-up after a Ctrl-C is not itself cut short by the next Ctrl-C.

A user who presses Ctrl-C during a sync save often presses it again at once. Before, that second one landed in
the removal of the unfinished save (or in the instant between a file's create and its record as this save's),
and the hidden temporary directory stayed beside the id for good, with no line on the log. A storm of real
SIGINTs over a loop of sync saves left 20 such directories in 8 s. Each test pins one instant with a blocking
storage (`tests.memory_storage.Control`) and sends real signals from another thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.probes import REPO

_SCRIPT = """
import logging, os, signal, sys, threading, time
import torch
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager

logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")

if __name__ == "__main__":
    root, control, first_block, second_block = sys.argv[1], Control(sys.argv[2]), sys.argv[3], sys.argv[4]
    again = int(sys.argv[5])
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = RecordingStorageConfig(control_dir=sys.argv[2])
    manager = CheckpointManager(config)
    manager.save(f"{root}/step", {"model": {"w": torch.ones(4)}, "extra": {"s": 1}})
    control.reset()
    control.block(first_block)

    def ctrl_c():
        control.wait_blocked()
        if second_block:  # blocks at the next instant while the first Ctrl-C unwinds the save
            control.block(second_block)
        os.kill(os.getpid(), signal.SIGINT)
        if second_block:
            control.wait_blocked()
            for _ in range(again):  # the user presses it again (and again)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
        control.reset()  # the blocked call goes on

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        manager.save(f"{root}/step", {"model": {"w": torch.full((4,), 2.0)}, "extra": {"s": 2}})
        print("save: returned", flush=True)
    except KeyboardInterrupt as exc:
        print(f"save: KeyboardInterrupt {exc}", flush=True)
        kept = exc  # as a notebook keeps the last exception (`sys.last_exc`)
    # The save's files, still open: a stream the save opened and never closed (or discarded).
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            held.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed since
            pass
    print("still open:", [path for path in held if path.startswith(root)], flush=True)
    try:
        loaded = manager.load(f"{root}/step", {"model": {"w": torch.zeros(4)}})
        print(f"loaded: {loaded['model']['w'].tolist()}", flush=True)
        manager.close()
    except KeyboardInterrupt:
        print("interrupted after the save", flush=True)
    print("entries:", sorted(os.listdir(root)), flush=True)
"""


_REPORT = "Checkpoint save of "  # what `_as_reported` says of an interrupted save, and then:
_NOTHING = "interrupted by SIGINT (Ctrl-C): nothing was committed at "


def _run(tmp_path: Path, first_block: str, second_block: str = "", again: int = 0) -> str:
    script = tmp_path / "ctrl_c.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(tmp_path / "ckpt"),
            str(tmp_path / "control"),
            first_block,
            second_block,
            str(again),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # the script imports tests.memory_storage
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, out
    assert "save: KeyboardInterrupt" in done.stdout, out
    return out


def test_ctrl_c_again_while_the_unfinished_save_is_removed_leaves_nothing_beside_the_id(tmp_path: Path) -> None:
    # Before: the second Ctrl-C stopped the removal; entries: ['.step.tmp-…', 'step'], and nothing was logged.
    out = _run(tmp_path, ".incomplete", "before rmdir", again=1)
    assert "entries: ['step']" in out, out
    # The held Ctrl-C is said, with the way out: before, it was held in silence, and a removal that takes long
    # (a hung mount, an object store's thousands of objects) looked like a process that ignores Ctrl-C.
    assert "LOG WARNING removing the unfinished save of" in out, out
    assert "SIGINT (Ctrl-C) during the removal of the unfinished save; its handler runs once it is removed" in out, out
    # The Ctrl-C pressed again still tells what became of the save: before, a bare KeyboardInterrupt replaced the
    # save's "interrupted (Ctrl-C): nothing was committed ..." ("save: KeyboardInterrupt " and nothing more).
    assert f"save: KeyboardInterrupt {_REPORT}" in out and _NOTHING in out, out
    assert "loaded: [1.0, 1.0, 1.0, 1.0]" in out or "interrupted after the save" in out, out


def test_ctrl_c_between_a_files_create_and_its_record_leaves_nothing_beside_the_id(tmp_path: Path) -> None:
    # Before: the file created but not yet recorded as this save's was taken for another program's, and the
    # temporary directory holding it stayed ("was not removed whole").
    # The second item's file, created on the training thread (one write thread, the default) once the first
    # item's file is recorded: an unrecorded file among recorded ones is what the discard leaves alone.
    out = _run(tmp_path, "after open extra_0.pt")
    assert "entries: ['step']" in out, out
    assert "not removed whole" not in out, out
    # Before: the Ctrl-C, held while the file was created, was raised once the stream was returned, before the
    # save entered it: the stream was never closed nor discarded, and its descriptor stayed open on the removed
    # file as long as the exception lived: "still open: ['…/.step.tmp-…/extra_0.pt (deleted)']".
    assert "still open: []" in out, out
    # The Ctrl-C held while the file was created is said, with the way out (a create that hangs, such as an
    # fsspec backend's open over the network, held it in silence before).
    assert "SIGINT (Ctrl-C) during the create of the file; its handler runs once it is created" in out, out
    assert "loaded: [1.0, 1.0, 1.0, 1.0]" in out or "interrupted after the save" in out, out


def test_a_third_ctrl_c_stops_the_removal_and_says_what_it_left(tmp_path: Path) -> None:
    # The way out of a removal that does not end (a hung mount) is the signal once more; what it leaves is named
    # with the command that removes it. Before, the second Ctrl-C already stopped it, and nothing was logged.
    out = _run(tmp_path, ".incomplete", "before rmdir", again=2)
    assert "Could not remove the unfinished save at" in out and "KeyboardInterrupt" in out, out
    assert "torch-checkpointing gc" in out, out
    assert f"save: KeyboardInterrupt {_REPORT}" in out and _NOTHING in out, out


_SCRIPT_THREADS = """
import os, signal, sys, threading, time
import torch
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import CheckpointWriterConfig

if __name__ == "__main__":
    root, control = sys.argv[1], Control(sys.argv[2])
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = RecordingStorageConfig(control_dir=sys.argv[2])
    config.save.writer_config = CheckpointWriterConfig(file_write_max_threads=2)
    manager = CheckpointManager(config)
    control.block("model_0.pt")  # on a write thread, in the middle of the file

    def ctrl_c_twice():
        control.wait_blocked()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)  # while the save waits for its write threads to end
        time.sleep(1.0)
        control.reset()  # the write goes on

    threading.Thread(target=ctrl_c_twice, daemon=True).start()
    try:
        manager.save(f"{root}/step", {"model": {"w": torch.full((4,), 2.0)}, "extra": {"s": 2}})
    except KeyboardInterrupt:
        still = (control.root / "block_on").exists()
        print(f"save: KeyboardInterrupt; a write thread still writing: {still}", flush=True)
    time.sleep(2.0)  # the blocked write, released, ends either way
    manager.close()
    print("entries:", sorted(os.listdir(root)), flush=True)
"""


def test_ctrl_c_again_while_the_write_threads_end_waits_for_them(tmp_path: Path) -> None:
    # Before: the second Ctrl-C made the save return (and remove its files) while a write thread still wrote
    # into them: "a write thread still writing: True".
    script = tmp_path / "ctrl_c_threads.py"
    script.write_text(textwrap.dedent(_SCRIPT_THREADS))
    (tmp_path / "ckpt").mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), str(tmp_path / "control")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, out
    assert "save: KeyboardInterrupt; a write thread still writing: False" in done.stdout, out
    assert "entries: []" in done.stdout, out
    # A write thread ends only with its file (a large one on a slow disk: minutes): the held Ctrl-C is said,
    # with the way out. Before, it was held in silence.
    held = "SIGINT (Ctrl-C) during the wait for the files being written; its handler runs once they are written"
    assert held in out, out
