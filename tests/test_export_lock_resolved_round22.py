"""Round 22: two overwriting HF exports into one folder, one reaching it through a symbolic link and one by its
real path, take turns publishing.

The publish lock was an flock on the output path's parent as given: `/a/hf_link` (a link to `/real/hf`) locked
`/a` while an export to `/real/hf` locked `/real`, so both moved their files in at once, and the folder was left
with one export's index over a mix of both exports' shards, which looks complete. The lock is now taken on the
resolved folder's parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.probes import stop
from tests.test_export_attack_round16 import _OVERWRITE, SUBPROCESS_TIMEOUT_S, _save
from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf, import_hf

_N = 1500  # one 4-byte tensor per shard: 1500 renames, so that a publish can be stopped midway
_WAIT_FOR_LOCK_S = 5.0


def _values(offset: float) -> dict[str, torch.Tensor]:
    return {f"t{i:04d}": torch.full((1,), float(i) + offset) for i in range(_N)}


def _start_export(ckpt: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _OVERWRITE, str(ckpt), str(out)])


def _stopped_once_publishing(child: subprocess.Popen[bytes], first_new: Path) -> None:
    """SIGSTOP `child` the moment its first shard has moved in: it holds the publish lock from then on."""
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not os.path.lexists(first_new):
        assert child.poll() is None, f"the export ended (rc {child.returncode}) before it published"
        assert time.monotonic() < deadline, "the export never published"
    stop(child.pid)


def _staged(parent: Path, name: str, child: subprocess.Popen[bytes]) -> None:
    """Wait until `child`'s export has written its whole staging (its index), the step before it publishes."""
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not list(parent.glob(f".{name}.export-tmp-*/{INDEX_FILE_NAME}")):
        assert child.poll() is None, f"the export ended (rc {child.returncode}) before it staged its files"
        assert time.monotonic() < deadline, "the export never staged its files"
        time.sleep(0.01)


def test_exports_through_a_link_and_the_real_path_take_turns(tmp_path: Path) -> None:
    """Export A (the real path) is stopped inside its publish; export B (through a link) must wait for it, not
    publish meanwhile. Before, B finished while A was stopped (rc 0 within the wait), and once A went on the
    folder held A's index over a mix of A's and B's shards. Now B publishes after A, whole."""
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    export_hf(_save(tmp_path / "old", {"w": torch.arange(8.0)}), "model", real / "hf")
    os.symlink(real / "hf", links / "hf_link")
    first = real / "hf" / f"model-00001-of-{_N:05d}.safetensors"
    a = _start_export(_save(tmp_path / "a", _values(0.0)), real / "hf")
    b: subprocess.Popen[bytes] | None = None
    try:
        _stopped_once_publishing(a, first)
        b = _start_export(_save(tmp_path / "b", _values(0.5)), links / "hf_link")
        _staged(links, "hf_link", b)
        deadline = time.monotonic() + _WAIT_FOR_LOCK_S
        while b.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.poll() is None, f"export B ended (rc {b.returncode}) while A held the publish: they did not take turns"
        os.kill(a.pid, signal.SIGCONT)
        assert a.wait(timeout=SUBPROCESS_TIMEOUT_S) == 0
        assert b.wait(timeout=SUBPROCESS_TIMEOUT_S) == 0
    finally:
        for child in (a, b):
            if child is not None and child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(timeout=SUBPROCESS_TIMEOUT_S)
    back = import_hf(real / "hf")
    want = _values(0.5)  # B published last, whole
    assert set(back) == set(want)
    assert [k for k, v in want.items() if not torch.equal(back[k], v)] == []
    assert os.path.islink(links / "hf_link")
