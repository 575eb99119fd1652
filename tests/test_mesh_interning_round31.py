"""An interned device mesh is found by its ints only (round 31).

`get_device_mesh_spec` interns meshes in a table keyed on their values; `True == 1` and `1.0 == 1` hash and
compare equal to the int, so once a mesh of ints was interned, the same mesh spelled with a bool or a float rank
or size found that entry and was taken, while the same call before it was refused by field: whether a bad mesh
was refused depended on which meshes the process had built before.
"""

from __future__ import annotations

from typing import Any

import pytest

from torch_checkpointing.dtensor_metadata import get_device_mesh_spec
from torch_checkpointing.errors import ConfigTypeError

_BAD = [((2,), (0, True)), ((2,), (0, 1.0)), ((2.0,), (0, 1)), ((True, 2), (0, 1))]


@pytest.mark.parametrize(("shape", "data"), _BAD, ids=["bool-rank", "float-rank", "float-size", "bool-size"])
def test_a_bad_mesh_is_refused_after_its_int_twin_was_interned(shape: Any, data: Any) -> None:
    """Defect: no exception; the int mesh's interned spec was returned."""
    twin = (tuple(int(n) for n in shape), tuple(int(r) for r in data))
    assert get_device_mesh_spec("cpu", *twin).mesh_data == (0, 1)
    with pytest.raises(ConfigTypeError, match="DeviceMeshSpec.mesh_"):
        get_device_mesh_spec("cpu", shape, data)


def test_equal_int_meshes_still_share_one_spec() -> None:
    assert get_device_mesh_spec("cpu", (2,), (0, 1)) is get_device_mesh_spec("cpu", [2], [0, 1])
