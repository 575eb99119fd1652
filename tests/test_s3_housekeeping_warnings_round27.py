"""Unfinished multipart uploads that S3 housekeeping leaves behind are said at WARNING, never left in silence.

Their parts stay billed until aborted, and nothing lists them (no `ls`, no listing of the bucket shows them): a
person hears of them from the log or not at all.

* gc (and a failed save's cleanup) aborting a dead save's uploads through a store whose abort raised, or that
  answered with uploads left, said only "aborted 0 unfinished multipart upload(s)" at INFO.
* The move of a dead save's prefix to the trash (gc of a save of an earlier engine, without tags) aborts the
  uploads under it only once it has read the claim there as dead. A claim the store failed to serve (a 503)
  left every upload in place, and gc reported the save removed, without a word.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, Rule, _error_response
from tests.s3_server import S3Server, missing_s3_packages
from tests.test_objstore_round21 import _dead_pid
from tests.test_s3_attacks import through_proxy
from tests.test_s3_unfinished_uploads_round26 import _claim, _start_upload, _uploads
from torch_checkpointing.errors import ObjectStoreError
from torch_checkpointing.manifest import INCOMPLETE_MARKER
from torch_checkpointing.retention import collect_garbage
from torch_checkpointing.storage.fsspec_storage import FsspecStorage

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")


class _AbortsFail(FsspecStorage):
    """The real store, whose abort of unfinished uploads raises (`raises`) or leaves them all, saying nothing."""

    raises = True

    def abort_uploads(self, root: Path, uploads: list[tuple[str, str]]) -> list[str]:
        if self.raises:
            raise ObjectStoreError(f"abort of the uploads under {self.remap_path(root)} failed: 503 SlowDown")
        return [self.remap_path(Path(f"s3://{key}")) for key, _ in uploads]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("raises", [True, False], ids=["abort-raises", "abort-leaves-them"])
def test_uploads_gc_could_not_abort_are_said_at_warning(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture, raises: bool
) -> None:
    """Defect: only "gc of the unfinished save at ... aborted 0 unfinished multipart upload(s)" at INFO."""
    config = s3_server.config()
    storage = _AbortsFail(config)
    storage.raises = raises
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    storage.write(Path("run/step_1") / INCOMPLETE_MARKER, _claim(_dead_pid(), tags=True))  # a killed save
    _start_upload(storage, f"{run}/step_1/model_0.pt")
    with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
        report = collect_garbage(f"{config.url}/run", storage, unowned_after_s=3600)
    assert [lo.path for lo in report.removed] == [f"{config.url}/run/step_1"], report
    assert _uploads(storage, run) == [f"{run.split('/', 1)[1]}/step_1/model_0.pt"]  # still there, billed
    said = [m for m in _warnings(caplog) if "could not abort 1 unfinished multipart upload" in m]
    assert said and "step_1/model_0.pt" in said[0], _warnings(caplog)


class _ClaimUnreadableOnceMoved(FaultProxy):
    """Once a move to the trash has put its claim up, the dead save's own claim answers 503 to every GET."""

    moving = False

    def _answer(self, client: socket.socket, head: bytes, request_line: str) -> bool:
        self.moving = self.moving or (request_line.startswith("PUT ") and ".trash-" in request_line)
        if self.moving and request_line.startswith(f"GET /{self.bucket}/run/step_1/{INCOMPLETE_MARKER} "):
            client.sendall(_error_response(Rule(".", 503, "ServiceUnavailable")))
            return True
        return super()._answer(client, head, request_line)


def test_uploads_a_move_could_not_judge_are_aborted_by_the_gc_holding_the_id(
    s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect: the upload stayed and gc reported the save removed, with no WARNING at all. Since gc holds an
    earlier engine's dead save's id with its own claim (listing its uploads before the hold, aborting them after
    the move), the uploads the move could not judge are aborted all the same: none is left billed."""
    config = s3_server.config()
    storage = config.create_storage()
    run = storage.remap_path(Path("run")).split("://", 1)[1]
    storage.write(Path("run/step_1") / INCOMPLETE_MARKER, _claim(_dead_pid(), tags=False))  # an earlier engine's
    _start_upload(storage, f"{run}/step_1/model_0.pt")
    with _ClaimUnreadableOnceMoved(s3_server.port) as proxy:
        proxy.bucket = run.split("/", 1)[0]  # type: ignore[attr-defined]
        with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
            report = collect_garbage(
                f"{config.url}/run", through_proxy(config, proxy).create_storage(), unowned_after_s=3600
            )
        assert proxy.moving, proxy.seen  # the move to the trash happened, so the fault came where meant
    assert [lo.path for lo in report.removed] == [f"{config.url}/run/step_1"], report
    assert _uploads(storage, f"{run}/step_1/") == []
    aborted = [r.getMessage() for r in caplog.records if "aborted 1 unfinished multipart upload" in r.getMessage()]
    assert aborted and f"{config.url}/run/step_1" in aborted[0], [r.getMessage() for r in caplog.records]
