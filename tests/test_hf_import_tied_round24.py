"""`import_hf` into a model whose weights are tied, from a directory that stores the tied tensor once.

transformers' `save_pretrained` leaves out a tensor tied to another (`lm_head.weight` tied to
`embed_tokens.weight`): the model's own state dict, used as the template, holds both names over one memory.
Before: the import refused with `TemplateMismatchError: ... has no tensor(s) ['lm_head.weight']`, though filling
`embed.weight` fills it. A template tensor the directory lacks is still refused when it has memory of its own,
or shares only part of another's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from torch_checkpointing.errors import TemplateMismatchError
from torch_checkpointing.hf import import_hf


def _hf_dir(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    out = tmp_path / "hf"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_tied_weight_left_out_of_the_directory_is_filled_through_its_tie(tmp_path: Path) -> None:
    emb = torch.randn(5, 3)
    directory = _hf_dir(tmp_path, {"embed.weight": emb, "b": torch.ones(2)})
    shared = torch.zeros(5, 3)
    template = {"embed": {"weight": shared}, "lm_head": {"weight": shared}, "b": torch.zeros(2)}
    import_hf(directory, template)
    assert torch.equal(template["lm_head"]["weight"], emb)
    assert template["lm_head"]["weight"] is template["embed"]["weight"]
    assert torch.equal(template["b"], torch.ones(2))


@pytest.mark.parametrize(
    "lm_head",
    [
        lambda shared: torch.zeros(5, 3),  # memory of its own
        lambda shared: shared[:2],  # a part of the tied memory only
        lambda shared: shared.t(),  # the same memory read another way
    ],
)
def test_a_missing_tensor_that_is_no_exact_tie_is_still_refused(tmp_path: Path, lm_head: object) -> None:
    directory = _hf_dir(tmp_path, {"embed.weight": torch.randn(5, 3)})
    shared = torch.zeros(5, 3)
    template = {"embed": {"weight": shared}, "lm_head": {"weight": lm_head(shared)}}  # type: ignore[operator]
    with pytest.raises(TemplateMismatchError, match=r"no tensor\(s\) \['lm_head.weight'\]"):
        import_hf(directory, template)
    assert torch.equal(shared, torch.zeros(5, 3))  # nothing copied


def test_a_missing_empty_tensor_is_no_tie_of_another_empty_one(tmp_path: Path) -> None:
    directory = _hf_dir(tmp_path, {"a": torch.zeros(0, 3)})
    with pytest.raises(TemplateMismatchError, match=r"no tensor\(s\) \['b'\]"):
        import_hf(directory, {"a": torch.zeros(0, 3), "b": torch.zeros(0, 3)})
