"""An error passes as a shortage already named only when its errno says so, never on its words alone.

`raise_if_short_of_resources` let through, as a shortage "named already", any `OSError` whose text held "the
checkpoint was not found damaged", whatever its errno: an I/O error of a storage plugin that words its failures
so, or a file whose name holds those words (the name is in an `OSError`'s text), came out of the decoders' and the
opens' handlers bare, as if the process were short of descriptors, instead of as what it is. Now only EMFILE and
ENFILE pass as named; ENOMEM is always a `MemoryError`.
"""

from __future__ import annotations

import errno

import pytest

from torch_checkpointing.errors import UndecodableFileError, raise_if_short_of_resources, undecodable

_WORDS = "the checkpoint was not found damaged"


@pytest.mark.parametrize(
    "exc",
    [
        OSError(errno.EIO, f"Input/output error; {_WORDS}"),
        OSError(f"a plugin's failure; {_WORDS}"),  # no errno at all
        FileNotFoundError(errno.ENOENT, "No such file or directory", f"/ck/{_WORDS}.pt"),
        PermissionError(errno.EACCES, "Permission denied", f"/ck/{_WORDS}.pt"),
    ],
    ids=["EIO", "no-errno", "ENOENT-name", "EACCES-name"],
)
def test_words_without_a_shortage_errno_are_no_shortage(exc: OSError) -> None:
    """Defect: each was raised back unchanged, "named already", by `raise_if_short_of_resources`, and
    `undecodable` raised it instead of returning the file's error."""
    raise_if_short_of_resources(exc, "/ck/model_0.pt", "item 'model'")  # returns: no shortage
    assert isinstance(undecodable("/ck/model_0.pt", "item 'model'", exc), UndecodableFileError)


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_a_named_descriptor_shortage_still_passes_unchanged(code: int) -> None:
    named = OSError(code, f"Out of file descriptors reading /ck/model_0.pt for item 'model'; {_WORDS}")
    with pytest.raises(OSError) as caught:
        raise_if_short_of_resources(named, "/ck/other.pt", "another step")
    assert caught.value is named


def test_a_named_enomem_is_a_memory_error() -> None:
    with pytest.raises(MemoryError, match="/ck/model_0.pt"):
        raise_if_short_of_resources(OSError(errno.ENOMEM, f"mmap; {_WORDS}"), "/ck/model_0.pt", "item 'model'")
