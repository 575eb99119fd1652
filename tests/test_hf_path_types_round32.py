"""export_hf's output and import_hf's directory of a type no path is refuse naming the argument (round 32).

The readers refuse bytes, None or an int as a root naming the fix; the HF entry points passed them to a regex
and failed with a bare TypeError ("cannot use a string pattern on a bytes-like object", "expected str, bytes
or os.PathLike object, not NoneType") naming neither the argument nor the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_checkpointing.errors import ConfigTypeError
from torch_checkpointing.hf import export_hf, import_hf


@pytest.mark.parametrize("bad", [b"hf_out", None, 7], ids=["bytes", "none", "int"])
def test_export_output_of_no_path_type_is_refused_naming_it(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigTypeError, match="export's output.*must be a str or os.PathLike"):
        export_hf(tmp_path / "ckpt", "model", bad)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", [b"hf_in", None, 7], ids=["bytes", "none", "int"])
def test_import_directory_of_no_path_type_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ConfigTypeError, match="import_hf's directory.*must be a str or os.PathLike"):
        import_hf(bad)  # type: ignore[arg-type]
