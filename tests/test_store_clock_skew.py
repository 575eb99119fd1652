"""Ages of what the store stamped, measured on the store's own clock: a host whose clock is off never deletes or
puts back something live.

On NFS a file's ctime and mtime are stamped by the file server's clock, on an object store LastModified by the
service's. Each test runs the process that judges (gc, a listing, a marker's create, an export) with its clock
ahead of the store's, through an LD_PRELOAD shim (`tests/clock_skew.py`), against a real replace, save, create
or export paused in another process. Each failed before, when an age was this host's clock minus a store's
stamp:

* a live replace's copy moved aside was "made before its owner started" (a pid reused since), and gc put the
  old copy back under the id while the replace was between its two renames;
* another host's live save's temporary, or its replace's copy aside, was older than `unowned_after_s`, and gc
  removed the one and put back the other;
* latest_checkpoint() took a live replace's copy aside for a killed one's and returned None;
* another host's live marker create and live HF export lost their hidden files to a create and an export here;
* on S3, another host's trash made a moment ago was as old as the skew, and gc removed it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.clock_skew import skewed_env, stated_age_s
from tests.s3_server import missing_s3_packages, start_s3_server
from tests.test_long_names_and_removal import SUBPROCESS_TIMEOUT_S, _manager
from tests.test_s3_attacks import sync_manager
from torch_checkpointing.names import host_tag, trash_name
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.base_storage import local_store_now, store_now

# How far ahead of the store's clock the judging process's clock runs: far past every margin the engine allows
# (`OWNER_STARTED_AFTER_S`, the start-up of a child), well short of a day (`DEFAULT_UNOWNED_AGE_S`).
SKEW_S = 600.0

# A sync save of `sys.argv[1]` (value `sys.argv[2]`) without an atomic exchange (NFS) that pauses at
# `sys.argv[3]`: "between" its two renames (the old copy aside, the id empty), or "commit" (its temporary
# written, before it moves in). It says so by creating `sys.argv[4]`.paused, and goes on 0.5 s after `.go`
# exists.
PAUSED_SAVE = """
import os, sys, time
import torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.storage import filesystem

path, value, moment, flag = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
filesystem._renameat2 = lambda: None
real_rename = filesystem.LocalFileSystemStorage.rename
def pause():
    open(flag + ".paused", "w").close()
    deadline = time.monotonic() + 240
    while not os.path.exists(flag + ".go") and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # what `.go`'s maker does right after it meets the save still paused
def rename_and_pause(self, src, dst, *args, **kwargs):
    if moment == "commit" and ".tmp-" in os.path.basename(str(src)):
        pause()
    real_rename(self, src, dst, *args, **kwargs)
    if moment == "between" and os.path.basename(str(dst)).startswith(".old_"):
        pause()
filesystem.LocalFileSystemStorage.rename = rename_and_pause
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
    manager.save(path, {"model": {f"t{i}": torch.full((4,), value) for i in range(3)}}, step=1)
"""

# gc of `sys.argv[1]` with `unowned_after_s=sys.argv[2]`; its report as JSON.
GC = """
import json, sys
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.base_storage import local_store_now, store_now
report = collect_garbage(sys.argv[1], unowned_after_s=float(sys.argv[2]))
print(json.dumps({"removed": [lo.path for lo in report.removed], "kept": [[lo.path, why] for lo, why in report.kept],
                  "failed": [[lo.path, why] for lo, why in report.failed]}))
"""


def _state(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {f"t{i}": torch.full((4,), value) for i in range(3)}}


def _save(ckpt: Path, value: float) -> None:
    with _manager() as manager:
        manager.save(str(ckpt), _state(value), step=1)


def _loaded(ckpt: Path) -> float:
    with _manager() as manager:
        return float(manager.load(str(ckpt), _state(0.0))["model"]["t0"][0])


def _paused_save(ckpt: Path, value: float, moment: str, flag: Path) -> subprocess.Popen[bytes]:
    """A save of `ckpt` in a child, paused at `moment` once this returns."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PAUSED_SAVE, str(ckpt), str(value), moment, str(flag)], stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not Path(f"{flag}.paused").exists():
        assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, "the save never reached its pause"
        time.sleep(0.05)
    return proc


def _finished(proc: subprocess.Popen[bytes], flag: Path) -> str:
    """Let the paused save go on; "" once it succeeded, else the end of what it wrote to stderr."""
    Path(f"{flag}.go").touch()
    _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    return "" if proc.returncode == 0 else err.decode()[-3000:]


def _skewed_gc(root: Path, env: dict[str, str], unowned_after_s: float) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", GC, str(root), str(unowned_after_s)],
        env=env,
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return report


def _asides(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith(".old_"))


def test_gc_on_a_host_ahead_of_the_file_servers_clock_leaves_a_live_replaces_copy_aside(tmp_path: Path) -> None:
    """Failed before: the owner of the copy aside (a live process of this host) was judged to have started after
    the copy got its name (ctime by the store's clock, "now" by this host's), so gc took its pid for reused and
    put the old copy back under the id between the replace's two renames: the replace then failed."""
    root = tmp_path / "run"
    root.mkdir()
    ckpt = root / "latest"
    _save(ckpt, 1.0)
    replace = _paused_save(ckpt, 2.0, "between", tmp_path / "flag")
    try:
        aside = _asides(root)
        assert len(aside) == 1 and not ckpt.exists()
        report = _skewed_gc(root, skewed_env(tmp_path, SKEW_S), unowned_after_s=0)
        during = (_asides(root), ckpt.exists())
    finally:
        failure = _finished(replace, tmp_path / "flag")
    assert during == (aside, False), report
    assert failure == "" and _loaded(ckpt) == 2.0 and _asides(root) == []


def test_gc_on_another_host_ahead_of_the_file_servers_clock_leaves_a_live_replaces_copy_aside(
    tmp_path: Path,
) -> None:
    """Failed before: another host's copy aside, moved a moment ago, was as old as the skew, past
    `unowned_after_s` (`gc --older-than 60`): gc put the old copy back under the live replace."""
    root = tmp_path / "run"
    root.mkdir()
    ckpt = root / "latest"
    _save(ckpt, 1.0)
    replace = _paused_save(ckpt, 2.0, "between", tmp_path / "flag")
    try:
        aside = _asides(root)
        report = _skewed_gc(root, skewed_env(tmp_path, SKEW_S, hostname="another-host"), unowned_after_s=60)
        during = (_asides(root), ckpt.exists())
    finally:
        failure = _finished(replace, tmp_path / "flag")
    assert during == (aside, False), report
    assert failure == "" and _loaded(ckpt) == 2.0 and _asides(root) == []


# `latest_checkpoint(sys.argv[1])` once it lets the paused replace go on (`sys.argv[2]`.go): its path, or None.
READ_LATEST = """
import sys
from pathlib import Path
from torch_checkpointing import latest_checkpoint

Path(sys.argv[2] + ".go").touch()
info = latest_checkpoint(sys.argv[1])
print(None if info is None else info.path)
"""


def test_latest_on_a_host_ahead_of_the_file_servers_clock_waits_for_a_live_replace(tmp_path: Path) -> None:
    """Failed before: the copy a live replace had just moved aside was older than `REPLACE_GAP_MAX_AGE_S` by the
    clock of a host ahead of the file server, so it was taken for a killed replace's: latest_checkpoint() did not
    wait for the new copy and returned None (a resume starts over), though the replace finished 0.5 s later."""
    root = tmp_path / "run"
    root.mkdir()
    ckpt = root / "latest"
    _save(ckpt, 1.0)
    replace = _paused_save(ckpt, 2.0, "between", tmp_path / "flag")
    try:
        latest = subprocess.run(
            [sys.executable, "-c", READ_LATEST, str(root), str(tmp_path / "flag")],
            env=skewed_env(tmp_path, SKEW_S),
            capture_output=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
    finally:
        failure = _finished(replace, tmp_path / "flag")
    assert latest.stdout.decode().split() == [str(ckpt)], latest.stderr.decode()[-2000:]
    assert failure == "" and _loaded(ckpt) == 2.0


def test_gc_on_another_host_ahead_of_the_file_servers_clock_leaves_a_live_saves_temporary(tmp_path: Path) -> None:
    """Failed before: another host's live save's temporary (its owner lock is on that host), written a moment
    ago, was as old as the skew, past `unowned_after_s`: gc removed it, and the save's commit failed."""
    root = tmp_path / "run"
    root.mkdir()
    ckpt = root / "latest"
    save = _paused_save(ckpt, 3.0, "commit", tmp_path / "flag")
    try:
        temporaries = [n for n in os.listdir(root) if n.startswith(".")]
        assert len(temporaries) == 1
        env = {**skewed_env(tmp_path, SKEW_S), "TORCH_CHECKPOINTING_LOCK_DIR": str(tmp_path / "another-hosts-locks")}
        report = _skewed_gc(root, env, unowned_after_s=60)
        during = [n for n in os.listdir(root) if n.startswith(".")]
    finally:
        failure = _finished(save, tmp_path / "flag")
    assert during == temporaries, report
    assert failure == "" and _loaded(ckpt) == 3.0


def test_gc_on_a_host_ahead_of_the_object_stores_clock_keeps_another_hosts_trash_made_a_moment_ago(
    tmp_path: Path,
) -> None:
    """Failed before: LastModified (the store's clock, here a real S3 server's clock behind this host's) of a
    trash another host's retention made a moment ago, against this host's clock, read as `SKEW_S` old, past
    `unowned_after_s`: gc removed it under the retention still checking it."""
    if missing := missing_s3_packages():
        pytest.skip(f"the S3 tests need {', '.join(missing)}")
    server = start_s3_server(str(tmp_path), env=skewed_env(tmp_path, -SKEW_S))
    try:
        config = server.config()
        storage = config.create_storage()
        with sync_manager(config) as manager:
            manager.save("run/step_1", _state(1.0))
        other = "0badc0de" if host_tag() != "0badc0de" else "0badc0df"
        trash = Path("run") / trash_name("step_1", 4242, "abcdef01", other)
        storage.rename(Path("run/step_1"), trash, is_directory=True)  # another host's retention, just now
        report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=60)
        assert storage.exists(trash / "manifest.json"), report
        [(_, why)] = report.kept
        assert why.startswith("owner unknown on this host and only ") and why.endswith("s old (< 60s)"), report
        assert stated_age_s(why) < 10, report  # not SKEW_S
        assert storage.ls(Path("run")) == [trash.name]  # the clock's probe is gone
    finally:
        server.stop()


# `fsspec_storage._create_local(sys.argv[1], sys.argv[2])` as on NFS (no O_TMPFILE: the bytes go to a hidden
# name, then a link); with `sys.argv[3]` set, it pauses once its hidden file is made (`.paused`, then `.go`).
# Prints whether it created the file.
CREATE = """
import os, sys, time
from torch_checkpointing.storage import fsspec_storage

name, data, flag = sys.argv[1], sys.argv[2].encode(), sys.argv[3]
fsspec_storage._HAS_TMPFILE_LINKS = False
real_write_all = fsspec_storage._write_all
def pause_then_write(fd, view):
    open(flag + ".paused", "w").close()
    deadline = time.monotonic() + 240
    while not os.path.exists(flag + ".go") and time.monotonic() < deadline:
        time.sleep(0.05)
    real_write_all(fd, view)
if flag:
    fsspec_storage._write_all = pause_then_write
print(fsspec_storage._create_local(name, data))
"""


def test_a_create_on_a_host_ahead_of_the_file_servers_clock_leaves_another_hosts_live_create_alone(
    tmp_path: Path,
) -> None:
    """Failed before: the hidden file of another host's create (a claim marker on `file://` over NFS) made a
    moment ago was over a minute old by this host's clock, so this host removed it as a dead creator's, and the
    live creator's link then failed (FileNotFoundError) instead of telling it lost the race."""
    marker, flag = tmp_path / ".incomplete", tmp_path / "flag"
    first = subprocess.Popen(
        [sys.executable, "-c", CREATE, str(marker), "first", str(flag)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not Path(f"{flag}.paused").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1].decode()[-2000:]
        time.sleep(0.05)
    hidden = [n for n in os.listdir(tmp_path) if ".creating-" in n]
    second = subprocess.run(
        [sys.executable, "-c", CREATE, str(marker), "second", ""],
        env=skewed_env(tmp_path, SKEW_S, hostname="another-host"),
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    during = [n for n in os.listdir(tmp_path) if ".creating-" in n]
    Path(f"{flag}.go").touch()
    out, err = first.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert second.stdout.decode().split() == ["True"], second.stderr.decode()[-2000:]
    assert during == hidden and len(hidden) == 1, second.stderr.decode()[-2000:]
    assert (first.returncode, out.decode().split()) == (0, ["False"]), err.decode()[-2000:]
    assert marker.read_bytes() == b"second"


# `export_hf(sys.argv[1], "model", sys.argv[2])`; with `sys.argv[3]` set, paused once its first shard is written
# into its staging folder (`.paused`, then `.go`).
EXPORT = """
import os, sys, time
import safetensors.torch
from torch_checkpointing.hf import export_hf

flag = sys.argv[3]
real_save_file = safetensors.torch.save_file
def save_then_pause(*args, **kwargs):
    real_save_file(*args, **kwargs)
    if not os.path.exists(flag + ".paused"):
        open(flag + ".paused", "w").close()
        deadline = time.monotonic() + 240
        while not os.path.exists(flag + ".go") and time.monotonic() < deadline:
            time.sleep(0.05)
if flag:
    safetensors.torch.save_file = save_then_pause
export_hf(sys.argv[1], "model", sys.argv[2])
"""


def test_an_export_on_another_host_a_day_ahead_of_the_file_servers_clock_leaves_a_live_exports_staging(
    tmp_path: Path,
) -> None:
    """Failed before: another host's live export's staging folder, written a moment ago, was older than a day
    (`DEFAULT_UNOWNED_AGE_S`) by the clock of a host two days ahead of the file server: the export beside it
    removed it, and the live export's move into place failed."""
    _save(tmp_path / "ckpt", 1.0)
    flag = tmp_path / "flag"
    first = subprocess.Popen(
        [sys.executable, "-c", EXPORT, str(tmp_path / "ckpt"), str(tmp_path / "hf-a"), str(flag)],
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while not Path(f"{flag}.paused").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1].decode()[-2000:]
        time.sleep(0.05)
    staging = [n for n in os.listdir(tmp_path) if ".export-tmp-" in n]
    second = subprocess.run(
        [sys.executable, "-c", EXPORT, str(tmp_path / "ckpt"), str(tmp_path / "hf-b"), ""],
        env=skewed_env(tmp_path, 2 * 86400.0, hostname="another-host"),
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    during = [n for n in os.listdir(tmp_path) if ".export-tmp-" in n]
    Path(f"{flag}.go").touch()
    _, err = first.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert second.returncode == 0, second.stderr.decode()[-2000:]
    assert during == staging and len(staging) == 1, second.stderr.decode()[-2000:]
    assert first.returncode == 0, err.decode()[-2000:]
    assert sorted(os.listdir(tmp_path / "hf-a")) == sorted(os.listdir(tmp_path / "hf-b"))


def test_a_store_whose_clock_cannot_be_probed_is_measured_by_this_hosts_and_tried_once_per_period(
    tmp_path: Path,
) -> None:
    """Where no probe can be written (a read-only mount; a bucket this user may only read), ages fall back to
    this host's clock, and the probe is not tried again at every age judged (on an object store, a request)."""
    tries: list[None] = []

    def refused() -> None:
        tries.append(None)

    where = str(tmp_path / "read-only")
    for _ in range(3):
        assert abs(store_now(where, refused) - time.time()) < 1.0
    assert len(tries) == 1
    assert abs(local_store_now(tmp_path) - time.time()) < 5.0  # the probe of a writable folder: this store's now
    assert os.listdir(tmp_path) == []  # no probe left behind
