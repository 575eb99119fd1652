"""`verify` of a checkpoint on an object store that fails to answer must not say FAILED.

Exit 1 (`"ok": false`) means the checkpoint is damaged, and `verify || rm` deletes it. A store that cannot be
reached, or that answers a request with an error, says nothing about the checkpoint's bytes: `ls`, `inspect`
and `diff` exit 2 (the command could not run), and so must `verify`. Before, `verify` said FAILED, exit 1,
both for a store it could not reach at all and for one that failed the request for one file.

The CLI runs as an operator runs it: a process of its own, reaching the real local S3 server (moto) through
the environment, through a proxy that fails the requests a rule names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.memory_storage import free_port
from tests.s3_faults import FaultProxy, Rule
from tests.s3_server import S3Server
from tests.test_s3_attacks import state, sync_manager

TIMEOUT_S = 120


def _cli_json(env: dict[str, str], *argv: str) -> tuple[int, dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "--json", *argv],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, **env, "AWS_MAX_ATTEMPTS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("failing", ["unreachable", "HEAD .*step_2/model_0.pt", "GET .*step_2/manifest.json"])
def test_verify_of_a_store_that_fails_to_answer_exits_2_never_failed(s3_server: S3Server, failing: str) -> None:
    config = s3_server.config()
    with sync_manager(config) as manager:
        manager.save("run/step_2", state(2.0))
    ckpt = f"{config.url}/run/step_2"
    env = s3_server.client_env()
    code, doc = _cli_json(env, "verify", ckpt)
    assert code == 0 and doc["ok"] is True and doc["checkpoint"] == ckpt, doc  # the control, and its URL as given
    port = s3_server.port
    with FaultProxy(port) as proxy:
        if failing == "unreachable":
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        else:
            env["AWS_ENDPOINT_URL"] = proxy.endpoint
            proxy.rules = [Rule(failing, 500, "InternalError")]
        code, doc = _cli_json(env, "verify", ckpt)
    assert code == 2, (code, doc)
    assert doc.get("ok") is not False and doc["kind"] in {"ObjectStoreError", "OSError"}, doc
