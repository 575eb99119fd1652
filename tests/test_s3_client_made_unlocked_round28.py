"""A storage whose S3 client takes long to make holds up no storage of another store.

A storage's client is made when it is built (its credentials are read then). Making it may wait: on a
`credential_process`, an STS AssumeRole, the instance metadata service. It was made under the one lock that
guards the process's shared filesystems, so a thread building a storage of any other store waited as long,
though its own client was ready at once. Here the slow client is a real profile whose credential_process waits
for a file the test makes; the other storage talks to the real test server.
"""

from __future__ import annotations

import stat
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.s3_server import S3Server, missing_s3_packages
from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_HANG_BOUND_S = 30.0  # the other store's storage takes well under a second; this only stops a hang


def _profile_waiting_for(gate: Path, started: Path, folder: Path) -> Path:
    """An AWS config whose profile `slow` gets its credentials from a process that makes `started`, then waits for
    `gate` (30 s at most)."""
    script = folder / "credentials.sh"
    script.write_text(
        "#!/bin/sh\n"
        f"touch '{started}'\n"
        f"for _ in $(seq 600); do [ -e '{gate}' ] && break; sleep 0.05; done\n"
        'echo \'{"Version": 1, "AccessKeyId": "testing", "SecretAccessKey": "testing"}\'\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    config = folder / "config"
    config.write_text(f"[profile slow]\ncredential_process = {script}\nregion = us-east-1\n")
    return config


def test_a_storage_of_another_store_is_built_while_a_client_waits_for_its_credentials(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: the second storage waited for the first one's credential_process ("built while the other waits:
    False"), here until the gate opened after `_HANG_BOUND_S`."""
    gate, started = tmp_path / "gate", tmp_path / "started"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(_profile_waiting_for(gate, started, tmp_path)))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    for name in ("AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    options = {k: v for k, v in s3_server.storage_options().items() if k != "skip_instance_cache"}
    errors: list[BaseException] = []

    def build(storage_options: dict[str, object], then: bool) -> None:
        try:
            storage = FsspecStorageConfig(url=f"s3://{bucket}", storage_options=storage_options).create_storage()
            if then:
                storage.write(Path(f"s3://{bucket}/run/object"), b"A")
        except BaseException as exc:  # said by the assertion below
            errors.append(exc)

    slow = threading.Thread(target=build, args=({"profile": "slow", "endpoint_url": s3_server.endpoint}, False))
    slow.start()
    try:
        for _ in range(int(_HANG_BOUND_S / 0.05)):  # until the slow client waits for its credentials
            if started.exists() or not slow.is_alive():
                break
            time.sleep(0.05)
        assert started.exists(), errors
        other = threading.Thread(target=build, args=(options, True))
        other.start()
        other.join(_HANG_BOUND_S)
        built_meanwhile = not other.is_alive() and slow.is_alive()
    finally:
        gate.touch()
        slow.join(_HANG_BOUND_S)
    other.join(_HANG_BOUND_S)
    assert not errors, errors
    assert built_meanwhile, "built while the other waits: False"
