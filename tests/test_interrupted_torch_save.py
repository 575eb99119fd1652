"""A Ctrl-C inside torch.save's clean-up must not abort the process later.

torch's zip writer writes the end of its archive from its C++ destructor when torch.save did not (an interrupt
that lands in its `__exit__` before that write). The destructor runs when the writer is collected, which can be
any later garbage collection; the write then went to the item's stream, closed by the failed save, which raised,
and an exception thrown out of a C++ destructor ends the process (`terminate called after throwing an instance
of 'pybind11::error_already_set'`, SIGABRT). Found by a SIGINT storm over sync saves; the child below lands the
interrupt there on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent(
    """
    import gc, sys
    import torch
    import torch.serialization as serialization
    from torch_checkpointing import CheckpointManager

    if __name__ == "__main__":
        root = sys.argv[1]
        manager = CheckpointManager(CheckpointManager.Config.with_sync_save())
        real_exit = serialization._open_zipfile_writer_buffer.__exit__

        def interrupted_exit(self, *args):
            raise KeyboardInterrupt  # before write_end_of_file: the zip writer is left unfinished

        serialization._open_zipfile_writer_buffer.__exit__ = interrupted_exit
        try:
            manager.save(f"{root}/c", {"model": {"w": torch.ones(1000)}})
            print("saved", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        serialization._open_zipfile_writer_buffer.__exit__ = real_exit
        gc.collect()  # the abandoned zip writer's destructor runs here
        manager.save(f"{root}/c", {"model": {"w": torch.full((1000,), 2.0)}})
        into = {"model": {"w": torch.zeros(1000)}}
        manager.load(f"{root}/c", into=into)
        print("restored", bool(torch.equal(into["model"]["w"], torch.full((1000,), 2.0))), flush=True)
        manager.close()
    """
)


def test_an_interrupt_in_torch_save_exit_leaves_no_writer_that_aborts_the_process(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, f"rc {proc.returncode}; stderr:\n{proc.stderr[-3000:]}"
    assert proc.stdout.split() == ["interrupted", "restored", "True"], proc.stdout
    assert not (tmp_path / "c").exists() or (tmp_path / "c" / "manifest.json").exists()
