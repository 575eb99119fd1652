"""Storage backends, and how a manager built without a storage config picks one from a checkpoint id.

A plain path, or a `file://` / `local://` URL, is the local filesystem (`LocalFileSystemStorageConfig`).
Any other URL scheme (`s3://bucket/run/step_100`, `gs://...`) names an fsspec filesystem, reached through
`FsspecStorageConfig` with the credentials and endpoint of the environment.
"""

from __future__ import annotations

import urllib.parse
from typing import TYPE_CHECKING

from torch_checkpointing.errors import ConfigError

if TYPE_CHECKING:
    from torch_checkpointing.storage.fsspec_storage import FsspecStorage

__all__ = ["LOCAL_SCHEMES", "fsspec_storage_for", "local_path_of"]

# URL schemes that name the local filesystem, as fsspec spells it.
LOCAL_SCHEMES = frozenset({"file", "local"})


def local_path_of(url: str) -> str:
    """The path a `file:///abs/path` (or `file://localhost/...`) URL names; a ConfigError (a ValueError) for another
    host: `save("file://~/run")` raised a bare ValueError where the readers' ConfigError said the same."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(
            f"Checkpoint id {url!r} names the host {parts.netloc!r}; a {parts.scheme}:// id must be a local path "
            f"such as '{parts.scheme}:///abs/runs/step_100' (three slashes), or a plain path."
        )
    return urllib.parse.unquote(parts.path)


def fsspec_storage_for(scheme: str, checkpoint_id: str) -> FsspecStorage:
    """The `FsspecStorage` for `scheme` (config from the environment), or an error that names the fix.

    Built before the manager lets go of its local storage, so a missing package fails the call that named the
    store and leaves the manager as it was. The backend module is imported here, not at package import.
    """
    from torch_checkpointing.storage.fsspec_storage import FsspecStorageConfig, shortage_named

    try:
        with shortage_named(f"set-up of the {scheme}:// client for {checkpoint_id}"):
            return FsspecStorageConfig(protocol=scheme).create_storage()
    except ImportError as exc:
        also = (
            ""
            if scheme in ("s3", "s3a")
            else f", plus the fsspec package for {scheme}:// (gcsfs for gs://, adlfs for az://)"
        )
        raise ImportError(
            f"Checkpoint id {checkpoint_id!r} names a {scheme}:// store, which is reached through fsspec: "
            f"pip install 'torch-checkpointing[s3]'{also}. ({exc})"
        ) from exc
    except ValueError as exc:  # fsspec: "Protocol not known"
        raise ValueError(
            f"Checkpoint id {checkpoint_id!r}: fsspec has no filesystem for {scheme}:// ({exc}). Pass a local path, "
            f"or a URL of a store fsspec knows (s3://, gs://, az://, ...)."
        ) from exc
