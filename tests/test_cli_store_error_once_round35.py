"""A store's error reaches the CLI's user once.

The storage logs each store error it raises (a caller that swallows one still leaves a trace), and the CLI
reports the error that ends the command: `torch-checkpointing ls s3://nobucket` printed the NoSuchBucket
twice, the WARNING and then the command's own `error:` line. A WARNING about the very error the command
reports is now left out; any other still shows.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from tests.s3_server import S3Server

pytest.importorskip("s3fs")

_BOUND_S = 120.0  # only stops a hang: each command takes a few seconds


def _cli(s3_server: S3Server, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **s3_server.client_env()}
    return subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *args], capture_output=True, text=True, env=env, timeout=_BOUND_S
    )


@pytest.mark.parametrize("command", [["ls"], ["verify"], ["inspect"]], ids=lambda c: c[0])
def test_a_missing_bucket_is_told_once_naming_it_and_the_fix(s3_server: S3Server, command: list[str]) -> None:
    bucket = f"nobucket-{uuid.uuid4().hex[:8]}"
    url = f"s3://{bucket}" if command == ["ls"] else f"s3://{bucket}/run/step_1"
    done = _cli(s3_server, *command, url)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    told = [line for line in done.stderr.splitlines() if "NoSuchBucket" in line]
    assert len(told) == 1, done.stderr
    assert repr(bucket) in told[0] and "create it, or fix the bucket name" in told[0], told
    assert told[0].startswith(f"torch-checkpointing {command[0]}: error:"), told
