"""Library version, read from the installed distribution so there is one source of truth."""

from __future__ import annotations

from importlib import metadata

from torch_checkpointing.errors import ConfigTypeError

_DIST_NAME = "torch-checkpointing"


class Version:
    """A version string `X.Y.Z[+sha]`, split on the first `+`."""

    def __init__(self, full: str) -> None:
        if not isinstance(full, str):  # was an AttributeError about `partition`
            raise ConfigTypeError(
                f"Version takes a version str such as '1.2.3+abc', got {type(full).__name__} {full!r:.80}"
            )
        self._full = full
        self._version, _, sha = full.partition("+")
        self._sha = sha or None

    def get_version(self) -> str:
        """`X.Y.Z`, without the `+sha` part."""
        return self._version

    def get_full_version(self) -> str:
        """The whole string, `+sha` included."""
        return self._full

    def get_sha(self) -> str | None:
        """What follows the first `+`, or None."""
        return self._sha

    def __str__(self) -> str:
        return self._full

    def __repr__(self) -> str:
        return f"Version({self._full!r})"


def _lookup() -> str | None:
    try:
        return metadata.version(_DIST_NAME)
    except metadata.PackageNotFoundError:
        return None


def get_version() -> Version | None:
    """The installed distribution's version, or None when it is not installed (e.g. run from a bare tree)."""
    found = _lookup()
    return Version(found) if found is not None else None


__version__: str = _lookup() or "Unknown"
"""The installed distribution's version string; `"Unknown"` when the lookup fails."""
