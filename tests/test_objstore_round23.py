"""Round 23 attacks on the object-store path, against a real S3 server (moto on loopback, tests/s3_server.py).

* A save that failed while the store was failing (an upload refused, then the cleanup's deletes refused too)
  left its claim. Once the store answered again, a new manager in the same process (a retry loop, a notebook
  cell run again) was refused the id for the life of the process, or a day: "another save is writing it (claim
  ... pid <this process>)". The claim's job had ended, its manager closed, but the claim's pid was alive (it is
  this very process), and the closed manager's owner lock file was gone, so nothing could prove it dead. A
  claim made in this process by a job whose every manager here has closed is now judged dead.
* One request failing while latest() checked the newest checkpoint (its manifest's GET, its marker's HEAD, a
  data file's HEAD) passed it over as "damaged": latest() answered the one before, a resume went back a step.
* An export or a diff meeting a damaged file named it twice, the second time as `s3:/bucket/...`; leftovers
  (list_leftovers, gc's report, `gc --json`) were named so too.
* A retention delete whose copy to the trash succeeded and whose delete of the source failed left the whole
  copy in the trash, while the report said the checkpoint was "left as it was".
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager, through_proxy
from torch_checkpointing.cli import main as cli_main
from torch_checkpointing.commit import Claim
from torch_checkpointing.discovery import latest_checkpoint, list_checkpoints, list_leftovers
from torch_checkpointing.errors import CheckpointError, ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import RetentionPolicy, collect_garbage, prune


def _w(out: dict[str, object]) -> float:
    return float(out["model"]["w"][0])  # type: ignore[index]


@pytest.mark.parametrize("then", ["save", "gc"])
def test_a_save_whose_cleanup_failed_leaves_the_id_to_the_next_manager_of_this_process(
    s3_server: S3Server, then: str
) -> None:
    config = s3_server.config()
    storage = config.create_storage()
    port = s3_server.port
    with FaultProxy(port) as proxy:
        proxy.rules = [
            Rule(r"^PUT \S*/run/step_2/model_0\.pt", 500, "InternalError"),  # the save fails
            Rule(r"^(DELETE |POST \S*\?delete)", 500, "InternalError"),  # and so does its cleanup
        ]
        with sync_manager(through_proxy(config, proxy)) as failing:
            try:
                failing.save("run/step_2", state(2.0))
            except CheckpointError:
                pass
            else:
                raise AssertionError("the save through a failing store succeeded")
    assert storage.exists(Path("run/step_2") / INCOMPLETE_MARKER)  # its claim is left: the store refused deletes
    if then == "gc":  # the store answers again; gc from this same process (before: kept, "may be live")
        report = collect_garbage(f"{config.url}/run", storage)
        assert [Path(lo.path).name for lo in report.removed] == ["step_2"], report
        assert not storage.exists(Path("run/step_2"))
    with sync_manager(config) as manager:  # the store answers again; a new manager of this same process
        manager.save("run/step_2", state(3.0))  # before: CommitError "another save is writing it (... pid <ours>)"
        assert _w(manager.load("run/step_2")) == 3.0


def test_a_claim_of_a_job_still_open_in_this_process_stays_live(s3_server: S3Server) -> None:
    """The other side: while a manager of the claim's job is open here, its claim is not taken over."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as first:
        target = Path("run/step_3")
        first.save("run/step_1", state(1.0))
        uid = first._ctx.uid
        claim = Claim(f".step_3.tmp-{uid}-9", uid, socket.gethostname(), os.getpid(), time.time(), tags=True)
        assert storage.create_object(target / INCOMPLETE_MARKER, claim.to_bytes())
        report = collect_garbage(f"{config.url}/run", storage)
        assert not report.removed and storage.exists(target / INCOMPLETE_MARKER), report


# One request of the newest checkpoint's check, failing on the server: its manifest's GET, its marker's HEAD (the
# manifest read checks the save is not in flight), a data file's HEAD (the intact check sizes every file).
_CHECKS_OF_THE_NEWEST = [
    r"^GET \S*/run/step_2/manifest\.json ",
    r"^HEAD \S*/run/step_2/\.incomplete ",
    r"^HEAD \S*/run/step_2/model_0\.pt ",
]


@pytest.mark.parametrize("failing", _CHECKS_OF_THE_NEWEST, ids=["manifest-get", "marker-head", "file-head"])
def test_a_store_failing_while_latest_checks_the_newest_raises_never_goes_back_a_step(
    s3_server: S3Server, failing: str
) -> None:
    """A store error is no damage: before, the newest checkpoint was skipped ("a damaged checkpoint", at
    WARNING) and latest() answered the one before it, so a resume went back a step, and listings dropped it."""
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    port = s3_server.port
    with FaultProxy(port) as proxy:
        storage = through_proxy(config, proxy).create_storage()
        root = f"{config.url}/run"
        assert latest_checkpoint(root, storage).path.endswith("/run/step_2")  # type: ignore[union-attr]
        proxy.rules = [Rule(failing, 500, "InternalError")]
        with pytest.raises(ObjectStoreError, match=r"run/step_2"):
            latest_checkpoint(root, storage)  # before: step_1
        if "manifest" in failing or "incomplete" in failing:
            with pytest.raises(ObjectStoreError, match=r"run/step_2"):
                list_checkpoints(root, storage)  # before: [step_1]


@pytest.mark.parametrize("command", ["export", "diff"])
def test_a_damaged_file_met_by_an_export_or_a_diff_is_named_once_by_its_url(
    s3_server: S3Server,
    tmp_path: Path,
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Before: `File s3://b/run/step_2/model_0.pt (s3:/b/run/step_2/model_0.pt) fails its CRC32 check`: the file
    named a second time, in the spelling `Path` folds a URL into, where a load's message names the item."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    damaged = bytearray(storage.read(Path("run/step_2/model_0.pt")))
    damaged[-40] ^= 0xFF
    storage.delete(Path("run/step_2/model_0.pt"))
    storage.write(Path("run/step_2/model_0.pt"), bytes(damaged))
    for name, value in s3_server.client_env().items():  # the CLI reaches the store as a job would
        monkeypatch.setenv(name, value)
    first, second = f"{config.url}/run/step_1", f"{config.url}/run/step_2"
    args = ["export", "--item", "model", "--to", "hf", second, str(tmp_path / "hf")] if command == "export" else []
    assert cli_main(["--plain", *(args or ["diff", first, second])]) != 0
    message = capsys.readouterr().err
    assert "fails its CRC32 check" in message and "run/step_2/model_0.pt (item 'model')" in message, message
    assert re.search(r"s3:/[^/]", message) is None, message


def test_leftovers_on_an_object_store_are_named_by_a_url_a_user_can_pass_on(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: `list_leftovers`, gc's report and `gc --json` named them `s3:/bucket/run/...` (the spelling `Path`
    folds a URL into), a path no tool takes, where the checkpoints' own entries are `s3://` URLs."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
    for name in ("manifest.json", "model_0.pt", "meta_0.pt"):  # what a retention delete cut short leaves: a trash
        storage.write(Path(f"run/.step_1.trash-999999-abcd/{name}"), storage.read(Path(f"run/step_1/{name}")))
    root = f"{config.url}/run"
    trash = f"{root}/.step_1.trash-999999-abcd"
    assert [lo.path for lo in list_leftovers(root, storage)] == [trash]
    for name, value in s3_server.client_env().items():
        monkeypatch.setenv(name, value)
    assert cli_main(["--json", "gc", "--dry-run", root]) == 0
    assert [lo["path"] for lo in json.loads(capsys.readouterr().out)["removed"]] == [trash]
    assert [lo.path for lo in collect_garbage(root, storage).removed] == [trash]
    with sync_manager(config) as manager:
        assert _w(manager.load("run/step_1")) == 1.0


@pytest.mark.parametrize(
    ("failing", "whole"),
    [
        (r"^PUT \S*/run/step_1/\.incomplete ", True),  # the source's marker: nothing of it deleted yet
        (r"^DELETE \S*/run/step_1/\.incomplete ", False),  # every file of it gone but its marker
    ],
    ids=["source-marker", "last-marker"],
)
def test_a_retention_delete_whose_move_to_the_trash_fails_says_where_the_checkpoint_is(
    s3_server: S3Server, failing: str, whole: bool
) -> None:
    """A delete on S3 copies the checkpoint to a trash prefix, then deletes the source. Before, when the source's
    delete failed, prune reported the checkpoint "left as it was" and left the whole copy in the trash too (twice
    the bytes, unnamed), or, with the source's files gone, said nothing of the marker left."""
    config = s3_server.config()
    storage = config.create_storage()
    with sync_manager(config) as manager:
        manager.save("run/step_1", state(1.0))
        manager.save("run/step_2", state(2.0))
    port = s3_server.port
    root = f"{config.url}/run"
    with FaultProxy(port) as proxy:
        proxy.rules = [Rule(failing, 500, "InternalError")]
        report = prune(root, RetentionPolicy(keep_last=1), through_proxy(config, proxy).create_storage())
    ((info, why),) = report.failed
    assert info.path == f"{root}/step_1"
    copies = [lo.path for lo in list_leftovers(root, storage) if "/.step_1.trash-" in lo.path]
    with sync_manager(config) as manager:
        if whole:  # still the checkpoint it was, and nothing else is left
            assert copies == [], copies  # before: the whole copy, left in the trash
            assert _w(manager.load("run/step_1")) == 1.0
        else:
            # Its files gone, the copy in the trash is the only whole one: it is kept (round 24: before, it was
            # deleted) and put back. The marker's delete failing still, the move back's own marker stays beside
            # the manifest copied last: a move's claim, dead once the move is over, which gc lets go of.
            assert copies == [] and "put back whole" in why, (copies, why)
            assert _w(manager.load("run/step_1")) == 1.0
            assert [lo.kind for lo in list_leftovers(root, storage) if lo.path == f"{root}/step_1"] == ["claim"]
            collect_garbage(root, storage)
            assert not storage.exists(Path("run/step_1/.incomplete"))
            assert _w(manager.load("run/step_1")) == 1.0
    with sync_manager(config) as manager:
        assert _w(manager.load("run/step_2")) == 2.0
