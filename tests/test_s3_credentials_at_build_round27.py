"""A storage configured from the environment signs with the credentials the environment names when it is built.

botocore reads AWS_ACCESS_KEY_ID (and the region, the profile) when the client is made, and s3fs makes it at the
first request. A storage built for one identity and first used after the variables changed signed as the other
one; so did every later storage built for the first identity, since they share its client. The store here is
the real test server behind a proxy that, like a real store, refuses a request signed with a key it does not
know.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.s3_faults import FaultProxy, Rule, _error_response
from tests.s3_server import S3Server, missing_s3_packages
from torch_checkpointing.discovery import storage_for

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_KNOWN_KEY = "AKIDKNOWNTOSTORE"
_OTHER_KEY = "AKIDANOTHERSTORE"


class _KeyCheckingProxy(FaultProxy):
    """Refuses (403 InvalidAccessKeyId) every request not signed with `_KNOWN_KEY`, as a store refuses a key it
    does not know (the test server takes any)."""

    def _answer(self, client: socket.socket, head: bytes, request_line: str) -> bool:
        if f"Credential={_KNOWN_KEY}/".encode() in head:
            return super()._answer(client, head, request_line)
        refusal = Rule(".", 403, "InvalidAccessKeyId")
        client.sendall(_error_response(refusal, head_only=request_line.startswith("HEAD ")))
        return True


def test_a_storage_first_used_after_the_credentials_changed_signs_with_those_it_was_built_with(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: the write below was signed with `_OTHER_KEY` (read from the environment at the first request) and
    refused: ObjectStoreError ... InvalidAccessKeyId."""
    bucket = s3_server.config().url.split("://", 1)[1]
    with _KeyCheckingProxy(s3_server.port) as proxy:
        for name, value in s3_server.client_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", _KNOWN_KEY)
        built = storage_for(f"s3://{bucket}/run")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", _OTHER_KEY)
        built.write(Path(f"s3://{bucket}/run/first-use"), b"A")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", _KNOWN_KEY)
        again = storage_for(f"s3://{bucket}/run")  # shares the first storage's client
        assert again.read(Path(f"s3://{bucket}/run/first-use")) == b"A"
