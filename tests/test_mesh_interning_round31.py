"""`get_device_mesh_spec` interns a mesh by its values, whatever integers spell them (round 31).

The intern table (an unbounded `functools.cache`) was keyed on the arguments as given. A 0-d tensor hashes by
identity: every call with the mesh's ranks as tensors (`mesh.mesh[i]`, `mesh.size(0)` spelled as a tensor) added
an entry holding its tensors and a `DeviceMeshSpec` of its own, for the life of the process, and equal meshes no
longer shared one object. numpy's integers hash as their ints, so they shared the ints' entry already.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from torch_checkpointing.dtensor_metadata import _interned_mesh, get_device_mesh_spec


@pytest.mark.parametrize("spell", [torch.tensor, np.int64, int], ids=["tensor", "int64", "int"])
def test_equal_meshes_share_one_entry(spell: Any) -> None:
    """Defect (tensor): 50 calls made 50 entries and 50 distinct specs ("assert 50 <= 1")."""
    get_device_mesh_spec("cpu", (2, 3), tuple(range(6)))
    before = _interned_mesh.cache_info().currsize
    specs = [
        get_device_mesh_spec("cpu", (spell(2), spell(3)), tuple(spell(r) for r in range(6)), ("dp", "tp"))
        for _ in range(50)
    ]
    assert _interned_mesh.cache_info().currsize - before <= 1
    assert all(s is specs[0] for s in specs)
    assert specs[0].mesh_shape == (2, 3) and type(specs[0].mesh_shape[0]) is int
