"""A script that ends with an async save still being written says so while the process waits for it.

Before, a script whose manager was never closed (a module-level manager, or one kept on an object) sat at
interpreter exit for as long as the last write took (up to `save.wait_timeout_secs`, 600 s by default) with
nothing on the log: a finished script could not be told from a hung one. The save still completes.
"""

from __future__ import annotations

from pathlib import Path

from tests.probes import run_script

_ENDS_WITHOUT_CLOSE = """
import logging, sys
import torch
from tests.memory_storage import Control, RecordingStorageConfig
from torch_checkpointing import CheckpointManager

logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(message)s")

if __name__ == "__main__":
    root, control, wait_first = sys.argv[1], Control(sys.argv[2]), sys.argv[3] == "wait"
    config = CheckpointManager.Config(storage_config=RecordingStorageConfig(control_dir=sys.argv[2]))
    manager = CheckpointManager(config)
    manager.save(f"{root}/step_1", {"model": {"w": torch.ones(4)}}).result(120)
    control.set_delay(2.0)  # the last write takes a while
    future = manager.save(f"{root}/step_2", {"model": {"w": torch.full((4,), 2.0)}})
    if wait_first:
        future.result(120)
    print("script ends", flush=True)  # no close(): the manager is still referenced at interpreter exit
"""


def _run(tmp_path: Path, wait_first: bool) -> str:
    ckpt, control = str(tmp_path / "ckpt"), str(tmp_path / "control")
    done = run_script(
        tmp_path / "ends_without_close.py", _ENDS_WITHOUT_CLOSE, ckpt, control, "wait" if wait_first else ""
    )
    out = f"{done.stdout}\n{done.stderr}"
    assert (tmp_path / "ckpt" / "step_2" / "manifest.json").is_file(), out  # the save completed at exit
    return done.stderr


def test_interpreter_exit_with_a_save_in_flight_says_it_waits_for_it(tmp_path: Path) -> None:
    err = _run(tmp_path, wait_first=False)
    said = err.find("At interpreter exit, the async save of")
    assert said >= 0, err
    assert "step_2 is still being written" in err and "at most 600 s" in err and "close()" in err, err
    committed = err.find("step_2 committed")
    assert committed > said, f"said only after the wait:\n{err}"


def test_interpreter_exit_with_nothing_in_flight_says_nothing(tmp_path: Path) -> None:
    err = _run(tmp_path, wait_first=True)
    assert "At interpreter exit" not in err, err
