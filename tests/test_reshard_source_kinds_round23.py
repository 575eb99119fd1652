"""A resharding source (or an exported Torch item) whose tensor is not a dense tensor with values (round 23).

A DTensorResharder load reads each source tensor block by block: it slices it and copies the slice into the
template. A crafted (or damaged) Torch file holding a meta tensor, a sparse tensor or a nested tensor where the
sharding metadata records a dense one passed every check of the check phase (only shape and dtype were
compared) and then failed with torch's own error: a meta tensor as a bare NotImplementedError ('Cannot copy out
of meta tensor') in the copy phase, after the entries before it were overwritten; a sparse one as a bare
NotImplementedError; a nested one as a bare RuntimeError ('NestedTensorImpl doesn't support sizes'). The
export of such a file failed the same bare ways. Now each is a CorruptCheckpointError naming the file and the
tensor, raised before anything is copied (docs/durability.md: load() returns exactly what was committed, or
raises a CheckpointError naming the file and the reason, having changed nothing).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.test_block_checksums import assert_resharding_load_refused
from tests.test_crafted_round9 import _forge
from tests.test_verified_loads import AlwaysReshard, _manager
from torch_checkpointing import ItemSpec
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import export_hf

N = 4096
FILL = -1.0

_KINDS: dict[str, Callable[[], torch.Tensor]] = {
    "meta": lambda: torch.empty(N, device="meta"),
    "sparse": lambda: torch.arange(float(N)).to_sparse(),
    "nested": lambda: torch.nested.nested_tensor([torch.arange(N / 2), torch.arange(N / 2)]),
}


def _crafted(root: Path, kind: str) -> Path:
    """A resharded item saved as {"v", "w"}, its file then holding `kind` at "w" (the manifest forged)."""
    m = _manager({"model": ItemSpec(resharder=AlwaysReshard())})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*plain.*")
            m.save(str(root), {"model": {"v": torch.arange(float(N)), "w": torch.arange(float(N))}})
    finally:
        m.close()
    torch.save({"v": torch.arange(float(N)), "w": _KINDS[kind]()}, root / "model_0.pt")
    _forge(root, "model_0.pt")
    return root


@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_a_resharding_source_tensor_without_dense_values_is_refused_before_any_copy(tmp_path: Path, kind: str) -> None:
    """Defect: torch's bare NotImplementedError / RuntimeError (meta: with 'v' already overwritten)."""
    root = _crafted(tmp_path / "ck", kind)
    template = {"v": torch.full((N,), FILL), "w": torch.full((N,), FILL)}
    assert_resharding_load_refused(root, ItemSpec(resharder=AlwaysReshard()), template, rf"model_0\.pt.*'w'.*{kind}")
    assert all(bool((t == FILL).all()) for t in template.values()), "a template entry was overwritten"


@pytest.mark.parametrize("kind", ["meta", "nested"])
def test_an_export_of_a_tensor_without_dense_values_is_refused_naming_it(tmp_path: Path, kind: str) -> None:
    """Defect: torch's bare errors from the export (sparse tensors were refused before, and still are)."""
    root = _crafted(tmp_path / "ck", kind)
    with pytest.raises(CorruptCheckpointError, match=rf"model_0\.pt.*'w'.*{kind}"):
        export_hf(root, "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
