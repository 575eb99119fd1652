"""Object-store leftovers of round 27: what a dry run writes, which clock a store's ages are read on, copies aside.

Each test runs the real thing: a moto S3 server in its own process (its clock skewed where the test needs a
store whose clock is not this host's: `tests/clock_skew.py`), real files, real processes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.clock_skew import skewed_env, stated_age_s
from tests.s3_server import S3Server, missing_s3_packages, start_s3_server
from tests.test_gc_users_files_round33 import earlier_versions_killed_save
from tests.test_long_names_and_removal import _manager
from tests.test_s3_attacks import sync_manager
from torch_checkpointing import CheckpointManager, asides, retention
from torch_checkpointing.asides import replace_under_way
from torch_checkpointing.discovery import OWNER_STARTED_AFTER_S, latest_checkpoint, pid_alive
from torch_checkpointing.names import aside_name, host_tag, new_nonce, trash_name
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

SKEW_S = 600.0
TIMEOUT_S = 120
_WRITES = re.compile(r'"(PUT|POST|DELETE) /([^/ ?]+)')


def _other_host() -> str:
    return "0badc0de" if host_tag() != "0badc0de" else "0badc0df"


def _state(value: float) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.full((8,), value)}}


def _writes_to(server: S3Server, bucket: str) -> list[str]:
    """The requests that change something (PUT, POST, DELETE) the server logged for `bucket`."""
    log = Path(server.log_path).read_text(errors="replace")
    return [line for line in log.splitlines() if (m := _WRITES.search(line)) and m[2] == bucket]


@pytest.fixture
def skewed_server(tmp_path: Path) -> Iterator[S3Server]:
    """A moto server whose clock is `SKEW_S` behind this host's (an object store's clock is its own)."""
    if missing := missing_s3_packages():
        pytest.skip(f"the S3 tests need {', '.join(missing)}")
    server = start_s3_server(str(tmp_path), env=skewed_env(tmp_path, -SKEW_S))
    try:
        yield server
    finally:
        server.stop()


def test_a_dry_run_gc_on_s3_writes_nothing_and_reads_the_stores_clock(skewed_server: S3Server) -> None:
    """Failed before: the dry run PUT (and DELETEd) a `.clock-probe-` object under the root to read the store's
    clock. Now it writes nothing, and still ages another host's trash by the store's clock (from the `Date` of
    a listing's answer): by this host's, made a moment ago read as `SKEW_S` old, "removable"."""
    config = skewed_server.config()
    storage = config.create_storage()
    bucket = config.url.removeprefix("s3://")
    with sync_manager(config) as manager:
        manager.save("run/step_1", _state(1.0))
    trash = Path("run") / trash_name("step_1", 4242, "abcdef01", _other_host())
    storage.rename(Path("run/step_1"), trash, is_directory=True)  # another host's retention, just now
    before = _writes_to(skewed_server, bucket)
    report = collect_garbage(f"{config.url}/run", storage, dry_run=True, unowned_after_s=60)
    assert _writes_to(skewed_server, bucket) == before
    [(_, why)] = report.kept
    assert stated_age_s(why) < 10 and not report.removed, report  # not SKEW_S


# A dry-run gc of `sys.argv[1]` as on NFS (no O_TMPFILE: a probe of the server's clock is a named file); prints
# the names of the files it created, then the report's kept reasons, one a line.
_DRY_GC_WITHOUT_TMPFILE = """
import os, sys
del os.O_TMPFILE
created = []
real_open = os.open
def recording_open(path, flags, *args, **kwargs):
    if flags & os.O_CREAT:
        created.append(os.path.basename(path))
    return real_open(path, flags, *args, **kwargs)
os.open = recording_open
from torch_checkpointing.retention import collect_garbage
report = collect_garbage(sys.argv[1], dry_run=True, unowned_after_s=60)
print(created)
for _, why in report.kept:
    print(why)
"""


def test_a_dry_run_gc_without_o_tmpfile_creates_no_probe_file(tmp_path: Path) -> None:
    """Failed before: on a filesystem without O_TMPFILE (NFS) the dry run made (and removed) a named
    `.clock-probe-` file in the root to read the server's clock; a dry run killed in between left it there."""
    root = tmp_path / "run"
    with _manager() as manager:
        manager.save(str(root / "step_1"), _state(1.0))
    os.rename(root / "step_1", root / trash_name("step_1", 4242, "abcdef01", _other_host()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-c", _DRY_GC_WITHOUT_TMPFILE, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    created, *kept = done.stdout.splitlines()
    assert created == "[]", done.stdout
    assert len(kept) == 1 and stated_age_s(kept[0]) < 10, done.stdout


def test_the_clock_of_one_endpoint_is_not_taken_for_anothers_with_the_same_bucket(
    tmp_path: Path, s3_server: S3Server
) -> None:
    """Failed before: the store's clock was kept by URL alone, so a read of `s3://b/run` on a store whose clock is
    `SKEW_S` ahead stood for `s3://b/run` on another endpoint for 30 s; gc there aged another host's trash made a
    moment ago as `SKEW_S` old and removed it (a job copying between two stores, a test's server restarted)."""
    if missing := missing_s3_packages():
        pytest.skip(f"the S3 tests need {', '.join(missing)}")
    ahead = start_s3_server(str(tmp_path), env=skewed_env(tmp_path, SKEW_S))
    try:
        bucket = f"same-{os.getpid()}-{id(tmp_path):x}"
        first, second = ahead.config(bucket), s3_server.config(bucket)
        ahead.make_bucket(bucket)
        s3_server.make_bucket(bucket)
        first.create_storage().store_now(Path("run"))  # the other store's clock, read first
        storage = second.create_storage()
        with sync_manager(second) as manager:
            manager.save("run/step_1", _state(1.0))
        trash = Path("run") / trash_name("step_1", 4242, "abcdef01", _other_host())
        storage.rename(Path("run/step_1"), trash, is_directory=True)  # another host's retention, just now
        report = collect_garbage(f"{second.url}/run", storage, unowned_after_s=60)
        assert storage.exists(trash / "manifest.json"), report
        [(_, why)] = report.kept
        assert stated_age_s(why) < 10, report
    finally:
        ahead.stop()


def _killed_replace_of_another_host(s3_server: S3Server) -> tuple[str, FsspecStorage, Path]:
    """A root on S3 whose `step_2` another host's replace moved aside and was killed: the id holds nothing."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", _state(1.0))
        manager.save("run/step_2", _state(2.0))
    aside = Path("run") / aside_name("step_2", 4242, new_nonce(), _other_host())
    storage.rename(Path("run/step_2"), aside, is_directory=True)
    return f"{config.url}/run", storage, aside


def test_gc_on_s3_puts_back_another_hosts_copy_aside_once_it_is_old(s3_server: S3Server) -> None:
    """Failed before: a copy aside on an object store was always 0 s old to `copy_to_put_back`, so another host's
    killed replace's copy was never moved back under its empty id, however old (kept as "the only copy")."""
    root, storage, aside = _killed_replace_of_another_host(s3_server)
    young = collect_garbage(root, storage, unowned_after_s=3600)
    assert not storage.exists(Path("run/step_2")) and storage.exists(aside / "manifest.json"), young
    time.sleep(2.0)  # a store's time: LastModified of whole seconds at worst
    report = collect_garbage(root, storage, unowned_after_s=1)
    assert storage.exists(Path("run/step_2/manifest.json")) and not storage.exists(aside), report


def test_loading_an_id_whose_copy_aside_on_s3_is_old_says_no_replace_is_under_way(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Failed before: a copy aside on an object store read as moved aside 0 s ago, so every load of its empty id
    waited for a live replace and then said the id "is being replaced ... load it again in a moment", for as
    long as the copy stayed (gc keeps another host's for a day), and every listing of the root waited too."""
    root, storage, _ = _killed_replace_of_another_host(s3_server)
    monkeypatch.setattr(asides, "REPLACE_GAP_MAX_AGE_S", 1.0)  # the 60 s a replace takes at most, shortened
    time.sleep(2.0)
    assert replace_under_way(storage, Path("run/step_2")) is None
    config = CheckpointManager.Config(storage_config=s3_server.config())
    with CheckpointManager(config) as manager, pytest.raises(FileNotFoundError) as raised:
        manager.load(f"{root}/step_2")
    assert "being replaced" not in str(raised.value), raised.value


def test_from_url_still_takes_a_url() -> None:
    assert FsspecStorageConfig.from_url("file:///data/run").protocol == "file"


def _process_with_pid(pid: int) -> subprocess.Popen[str] | None:
    """A live process (a `sleep`) given the pid `pid` by the kernel, as a pid is given again after its process
    died; None where the kernel gave another (a process of the machine started in between)."""
    script = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid; sleep 120 & echo $!; wait"
    shell = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert shell.stdout is not None
    if int(shell.stdout.readline() or 0) == pid:
        return shell
    os.killpg(shell.pid, signal.SIGKILL)
    shell.wait(timeout=TIMEOUT_S)
    return None


needs_pid_choice = pytest.mark.skipif(
    sys.platform != "linux" or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
    reason="needs /proc/sys/kernel/ns_last_pid (root) to give a pid again",
)


@needs_pid_choice
def test_gc_on_s3_tells_a_later_process_with_a_trashs_pid_from_its_maker(s3_server: S3Server) -> None:
    """Failed before: whether the live process with a hidden name's pid started after the name was made was read
    from a local ctime only, so on an object store a dead retention's trash (or a killed replace's copy aside)
    whose pid the kernel gave again counted as that later process's: kept ("its owner is alive") while it ran."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", _state(1.0))
        manager.save("run/step_2", _state(2.0))
    pid = next(p for p in range(20000, 30000) if not pid_alive(p) and not pid_alive(p - 1))
    trash = Path("run") / trash_name("step_1", pid, new_nonce(), host_tag())  # a dead retention's, pid `pid`
    storage.rename(Path("run/step_1"), trash, is_directory=True)
    time.sleep(OWNER_STARTED_AFTER_S + 1.0)
    later = next((p for _ in range(5) if (p := _process_with_pid(pid)) is not None), None)
    if later is None:
        pytest.skip(f"the kernel did not give pid {pid} again (a busy machine)")
    try:
        report = collect_garbage(f"{config.url}/run", storage)
        assert [Path(lo.path).name for lo in report.removed] == [trash.name], report
    finally:
        os.killpg(later.pid, signal.SIGKILL)
        later.wait(timeout=TIMEOUT_S)


def _unfinished_uploads(storage: FsspecStorage, prefix: str) -> list[str]:
    bucket, key, _ = storage.fs.split_path(prefix)
    return sorted(
        u["Key"] for u in storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key).get("Uploads", [])
    )


def test_gc_on_s3_removes_a_trash_whose_marker_is_empty_and_aborts_its_uploads(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Failed before: every read of a claim was a ranged GET, which S3 refuses for an empty object (416
    InvalidRange), and an earlier version's claim is an empty `.incomplete`. gc of a trash holding one (its
    process dead) failed for good, "The requested range is not satisfiable; `torch-checkpointing gc` will
    retry", and its unfinished upload stayed, billed; a delete of such a prefix failed alike."""
    config = s3_server.config()
    storage = config.create_storage()
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    trash = Path("run") / trash_name("step_9", int(dead.stdout), new_nonce(), host_tag())
    storage.write(trash / ".incomplete", b"")  # an earlier version's claim, moved to a trash name
    storage.write(trash / "model" / "0.bin", b"what its save wrote")
    bucket, key, _ = storage.fs.split_path(f"{run}/{trash.name}/model_0.pt")
    storage.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)  # a writer killed mid-file
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        report = collect_garbage(f"{config.url}/run", storage)
        storage.write(Path("run/old/.incomplete"), b"")
        storage.write(Path("run/old/model/0.bin"), b"x")
        storage.rmdir(Path("run/old"))
    assert [Path(lo.path).name for lo in report.removed] == [trash.name] and not report.failed, report
    assert _unfinished_uploads(storage, run) == [] and not storage.exists(Path("run"))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_listing_on_s3_that_ages_a_copy_aside_writes_nothing(s3_server: S3Server) -> None:
    """A listing (`latest_checkpoint`, every resume) that ages a copy aside reads the store's clock from an
    answer's `Date`: with the copy's age read from LastModified, it PUT and DELETEd a clock probe in the run."""
    root, storage, _ = _killed_replace_of_another_host(s3_server)
    bucket = root.removeprefix("s3://").split("/")[0]
    before = _writes_to(s3_server, bucket)
    assert latest_checkpoint(root, storage) is not None
    assert _writes_to(s3_server, bucket) == before


# Another gc pass in its own process: it holds the prefix `sys.argv[2]` (an earlier version's unfinished save)
# with its claim, says so, and waits to be killed, as a pass between its hold and its move.
_HOLDING_GC = """
import json, sys, time
from pathlib import Path
from torch_checkpointing import retention
from torch_checkpointing.commit import Claim
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

args = json.loads(sys.argv[1])
storage = FsspecStorageConfig(url=args["url"], storage_options=args["options"]).create_storage()
marker = Path(sys.argv[2]) / ".incomplete"
data, etag = storage.read_object(marker)
with retention._gc_pass() as uid:
    dead = Claim(token="", uid="", host="", pid=0, created=0.0)
    assert retention._hold_for_gc(storage, marker, etag, dead, uid, records=False) is not None
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_gc_pass_beside_another_that_holds_a_dead_saves_prefix_reports_no_failure(s3_server: S3Server) -> None:
    """Failed before: the pass that judged an earlier version's unfinished save dead, and found another gc pass
    holding it by the time it came to hold it, reported it failed ("a save of that id took it over"; the CLI
    exits 1): two passes at once (a job's retention beside `torch-checkpointing gc`) are no failure."""
    config = s3_server.config()
    storage = config.create_storage()
    written = earlier_versions_killed_save(storage, config, "run/old")  # an earlier version's killed save
    args = json.dumps({"url": config.url, "options": config.storage_options})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    judge = retention._why_keep
    others: list[subprocess.Popen[str]] = []

    def judged_then_held_by_another_gc(leftover: Any, *args_: Any, **kwargs: Any) -> str | None:
        why = judge(leftover, *args_, **kwargs)
        if why is None and leftover.path.endswith("run/old") and not others:
            other = subprocess.Popen(
                [sys.executable, "-c", _HOLDING_GC, args, "run/old"], stdout=subprocess.PIPE, text=True, env=env
            )
            others.append(other)
            assert other.stdout is not None and other.stdout.readline().strip() == "held"
        return why

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(retention, "_why_keep", judged_then_held_by_another_gc)
            report = collect_garbage(f"{config.url}/run", storage)
    finally:
        for other in others:
            other.kill()
            other.wait(timeout=TIMEOUT_S)
    assert others and not report.failed and not report.removed, report
    assert all(storage.exists(Path("run/old") / name) for name in written)  # the other pass's to collect
