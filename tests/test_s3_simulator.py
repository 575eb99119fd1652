"""`python -m simulator --storage-url s3://...` against a real local S3 server (moto, tests/s3_server.py).

The simulator is run as a user runs it: a subprocess whose environment names the endpoint and credentials
(`AWS_ENDPOINT_URL`, botocore's own variable), which every rank and async writer process inherits. The checks
look in the bucket itself, so a simulator that quietly wrote to a local directory fails them.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.s3_server import S3Server
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

ROOT = Path(__file__).resolve().parent.parent
_RUN_TIMEOUT_S = 480


def _env(server: S3Server) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, **server.client_env()}


def _simulator(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "simulator", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
    )


def _objects(server: S3Server, bucket: str) -> list[str]:
    storage = FsspecStorage(FsspecStorageConfig(protocol="s3", storage_options=server.storage_options()))
    storage.fs.invalidate_cache()
    return sorted(storage.fs.find(bucket))


@pytest.mark.multirank
def test_simulator_2_to_3_passes_against_s3_and_leaves_the_checkpoints_in_the_bucket(
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    bucket = f"sim-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    done = _simulator(
        _env(s3_server),
        tmp_path,
        "--world",
        "2->3",
        "--storage-url",
        f"s3://{bucket}/runs",
        "--keep",
        str(tmp_path / "kept"),
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "VERDICT: PASS" in done.stdout, out[-6000:]
    assert "checkpoints under s3://" in done.stdout
    objects = _objects(s3_server, bucket)
    # bucket/runs/simulator-<run>/<scenario>/.../manifest.json
    manifests = {o.split("/")[3] for o in objects if o.endswith("/manifest.json")}
    # layouts, its collision demo, the async race's three saves and the resharding checkpoint: all in S3
    for name in ("layouts", "reshard", "async-race"):
        assert name in manifests, f"no committed {name} checkpoint in s3://{bucket}: {objects[:40]}"
    assert any(o.endswith("/reshard/model_1.pt") for o in objects), objects[:40]
    assert not any(Path(tmp_path / "kept").rglob("manifest.json")), "checkpoints were written locally"


@pytest.mark.multirank
def test_without_keep_the_run_prefix_is_deleted_and_faults_is_skipped_with_its_reason(
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    bucket = f"sim-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    done = _simulator(
        _env(s3_server), tmp_path, "--world", "2", "--scenario", "layouts,faults", "--storage-url", f"s3://{bucket}/x"
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "VERDICT: PASS" in done.stdout, out[-6000:]
    assert "SKIPPED" in done.stdout and "does not run with --storage-url" in done.stdout, done.stdout[-3000:]
    assert _objects(s3_server, bucket) == []


def test_a_missing_bucket_is_one_clear_error_before_any_rank_starts(
    s3_server: S3Server,
    tmp_path: Path,
) -> None:
    done = _simulator(
        _env(s3_server), tmp_path, "--world", "2", "--scenario", "layouts", "--storage-url", "s3://no-such-bucket/p"
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "VERDICT: FAIL" in done.stdout
    assert "the store is not usable" in done.stdout and "no-such-bucket" in done.stdout, done.stdout[-3000:]
    assert "launching" not in done.stdout  # no rank was started against a store that cannot work


@pytest.mark.multirank
def test_a_file_url_runs_through_the_fsspec_storage(tmp_path: Path) -> None:
    """`file:///abs/dir` goes through FsspecStorageConfig too (commit file, no rename), with no server."""
    store = tmp_path / "store"
    store.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    done = _simulator(
        env,
        tmp_path,
        "--world",
        "2",
        "--scenario",
        "layouts",
        "--storage-url",
        f"file://{store}",
        "--keep",
        str(tmp_path / "kept"),
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert "VERDICT: PASS" in done.stdout
    manifests = sorted(str(p.relative_to(store)) for p in store.rglob("manifest.json"))
    assert len(manifests) == 2 and all(m.startswith("simulator-") for m in manifests), manifests  # layouts + shared


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("memory://x", "every rank is its own process"),
        ("file://relative/dir", "absolute path"),
        ("bucket/prefix", "expected an fsspec URL"),
        ("s3://", "expected an fsspec URL"),
    ],
)
def test_storage_urls_that_cannot_work_are_refused_by_the_parser(url: str, message: str) -> None:
    from simulator.cli import build_parser, plan_from_args

    args = build_parser().parse_args(["--world", "2", "--storage-url", url])
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        plan_from_args(args, "/nonexistent")


def test_a_storage_url_gives_each_run_its_own_prefix() -> None:
    from simulator.cli import build_parser, plan_from_args

    args = build_parser().parse_args(["--world", "2", "--storage-url", "s3://b/runs/"])
    first, second = plan_from_args(args, "/r"), plan_from_args(args, "/r")
    assert first.storage_url.startswith("s3://b/runs/simulator-")
    assert first.storage_url != second.storage_url
    assert first.checkpoints_at == first.storage_url
