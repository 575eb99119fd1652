"""A `url` of an alias of the config's protocol (`s3a://` with `s3`) is taken whatever this process used before.

The check that a config's `url` and `protocol` name one store compared the dotted names of their filesystem
classes: fsspec's table of known protocols names a class by its package (`s3fs.S3FileSystem`), its registry, once
the class was first used in the process, by its module (`s3fs.core.S3FileSystem`). So an alias was accepted in a
fresh process and refused ("is a s3a:// path, but this storage talks to s3://") in one that had built an S3
filesystem before: a job's config failed or not by what ran before it. Each case runs in a process of its own, as
fsspec's registry is the process's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.s3_server import missing_s3_packages

pytestmark = pytest.mark.skipif(bool(missing_s3_packages()), reason="needs the s3 extra")

_LAUNCH_BOUND_S = 120  # a second or two expected; this only stops a hang


def _config_built(url: str, protocol: str, first: str) -> str:
    code = f"""
        import fsspec
        from torch_checkpointing.errors import ConfigError
        from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig
        {first}
        try:
            FsspecStorageConfig(url={url!r}, protocol={protocol!r})
            print("accepted")
        except ConfigError as exc:
            print("refused:", exc)
        """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=_LAUNCH_BOUND_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(("url", "protocol"), [("s3a://bucket/run", "s3"), ("s3://bucket/run", "s3a")])
def test_an_alias_is_accepted_after_an_s3_filesystem_was_built(url: str, protocol: str) -> None:
    """Defect: refused: FsspecStorageConfig.url 's3a://bucket/run' is a s3a:// path, but this storage talks to
    s3:// (FsspecStorageConfig.protocol)."""
    assert _config_built(url, protocol, "fsspec.filesystem('s3', anon=True)") == "accepted"
    assert _config_built(url, protocol, "pass") == "accepted"  # in a fresh process, as before


def test_another_store_is_refused_after_an_s3_filesystem_was_built() -> None:
    """The check itself still holds: `gs://` with `s3` names two stores."""
    said = _config_built("gs://bucket/run", "s3", "fsspec.filesystem('s3', anon=True)")
    assert said.startswith("refused:") and "gs:// path" in said, said
