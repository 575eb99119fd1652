"""get_device_mesh_spec takes what DeviceMeshSpec takes, and refuses by field what it refuses (round 32).

The interning key was built with `tuple(...)` of each argument, which takes any iterable: a dict's keys became a
mesh shape, and a str of one character per dimension became the dimension names, where `DeviceMeshSpec` with the
same arguments (and metadata.json's reader) refused them naming the field.
"""

from __future__ import annotations

from typing import Any

import pytest

from torch_checkpointing.dtensor_metadata import DeviceMeshSpec, get_device_mesh_spec
from torch_checkpointing.errors import ConfigTypeError

_REFUSED = [
    ((2,), {0: "a", 1: "b"}, None, "mesh_data"),
    ({2: 0}, (0, 1), None, "mesh_shape"),
    ((2, 2), (0, 1, 2, 3), "xy", "mesh_dim_names"),
    ((1,), (0,), "x", "mesh_dim_names"),
    ((2, 2), (0, 1, 2, 3), {"x": 0, "y": 1}, "mesh_dim_names"),
]


@pytest.mark.parametrize(
    ("shape", "data", "names", "field"), _REFUSED, ids=[r[3] + str(i) for i, r in enumerate(_REFUSED)]
)
def test_get_device_mesh_spec_refuses_what_the_record_refuses(shape: Any, data: Any, names: Any, field: str) -> None:
    """Defect: `get_device_mesh_spec("cpu", (2, 2), (0, 1, 2, 3), "xy")` built a mesh named ('x', 'y'), and
    `get_device_mesh_spec("cpu", {2: 0}, (0, 1))` one of shape (2,)."""
    with pytest.raises(ConfigTypeError, match=field):
        DeviceMeshSpec("cpu", shape, data, names)
    with pytest.raises(ConfigTypeError, match=field):
        get_device_mesh_spec("cpu", shape, data, names)


def test_lists_are_still_taken_as_their_tuples() -> None:
    mesh = get_device_mesh_spec("cpu", [2, 2], [0, 2, 1, 3], ["dp", "tp"])
    assert mesh is get_device_mesh_spec("cpu", (2, 2), (0, 2, 1, 3), ("dp", "tp"))
    assert mesh.mesh_dim_names == ("dp", "tp")
