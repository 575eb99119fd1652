"""Hugging Face interop: export to HF-layout safetensors shards (consolidating DTensor shards), and import."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from torch_checkpointing import CheckpointManager, ItemSpec, TemplateMismatchError
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf, import_hf, iter_item_tensors, parse_size
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig


def _manager(**items: ItemSpec) -> CheckpointManager:
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = items
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(cfg)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(50, 8, generator=g),
        "layers.0.attn.weight": torch.randn(8, 8, generator=g),
        "layers.0.attn.bias": torch.randn(8, generator=g),
        "layers.1.attn.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "position_ids": torch.arange(50),
        "step": 7,  # not a tensor: skipped (safetensors holds tensors only)
    }


def _load_all(out: Path) -> dict[str, torch.Tensor]:
    index = json.loads((out / INDEX_FILE_NAME).read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(out / shard)))
    assert set(got) == set(index["weight_map"])
    return got


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(123) == 123
    assert parse_size("1.5 MB") == 1_500_000
    with pytest.raises(ValueError, match="Cannot read size"):
        parse_size("lots")


def test_export_writes_hf_shards_and_index_with_exact_values(tmp_path: Path) -> None:
    sd = _state()
    with _manager() as m:
        m.save(str(tmp_path / "c"), {"model": sd})
    report = export_hf(tmp_path / "c", "model", tmp_path / "hf", max_shard_size=1000)
    shards = report.files[:-1]
    assert report.files[-1] == INDEX_FILE_NAME and len(shards) >= 2
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    index = json.loads((tmp_path / "hf" / INDEX_FILE_NAME).read_text())
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    got = _load_all(tmp_path / "hf")
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_export_refuses_a_dtype_safetensors_cannot_store_before_writing(tmp_path: Path) -> None:
    """complex128 is not a safetensors dtype: a bare KeyError from inside the library before."""
    with _manager() as m:
        m.save(str(tmp_path / "c"), {"model": {"a": torch.ones(2), "z": torch.ones(2, dtype=torch.complex128)}})
    with pytest.raises(ValueError, match=r"safetensors has no dtype for 1 tensor\(s\): z \(torch\.complex128\)"):
        export_hf(tmp_path / "c", "model", tmp_path / "hf", max_shard_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no export folder, no hidden staging left


def test_export_dtype_casts_floats_only(tmp_path: Path) -> None:
    sd = _state()
    with _manager() as m:
        m.save(str(tmp_path / "c"), {"model": sd})
    export_hf(tmp_path / "c", "model", tmp_path / "hf", dtype=torch.bfloat16)
    got = _load_all(tmp_path / "hf")
    assert got["embed.weight"].dtype == torch.bfloat16 and torch.equal(
        got["embed.weight"], sd["embed.weight"].bfloat16()
    )
    assert got["position_ids"].dtype == torch.int64


def test_export_streams_one_tensor_at_a_time_within_the_shard_bound(tmp_path: Path, monkeypatch: Any) -> None:
    sd = {f"w{i}": torch.full((100,), float(i)) for i in range(10)}  # 400 bytes each
    sd["big"] = torch.zeros(1000)  # 4000 bytes: larger than a shard, gets one of its own
    with _manager() as m:
        m.save(str(tmp_path / "c"), {"model": sd})
    exported: list[str] = []
    written: list[int] = []

    import safetensors.torch

    real_save = safetensors.torch.save_file

    def measuring_save(tensors: dict[str, torch.Tensor], path: str, metadata: Any = None) -> None:
        exported.extend(tensors)
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", measuring_save)
    export_hf(tmp_path / "c", "model", tmp_path / "hf", max_shard_size=1000)
    assert sorted(exported) == sorted(sd)  # every tensor in exactly one shard, shard by shard
    assert all(n <= 1000 for n in written if n != 4000) and 4000 in written
    got = _load_all(tmp_path / "hf")
    assert all(torch.equal(got[k], v) for k, v in sd.items())


def test_export_of_a_safetensors_item_and_a_bare_tensor_item(tmp_path: Path) -> None:
    items = {"weights": ItemSpec(layout=LayoutInfo("w.safetensors", SafetensorsSerialization()))}
    with _manager(**items) as m:
        m.save(str(tmp_path / "c"), {"weights": {"a": {"b": torch.ones(2)}}, "head": torch.arange(3.0)})
    export_hf(tmp_path / "c", "weights", tmp_path / "w")
    assert torch.equal(_load_all(tmp_path / "w")["a.b"], torch.ones(2))
    export_hf(tmp_path / "c", "head", tmp_path / "h")
    assert torch.equal(_load_all(tmp_path / "h")["head"], torch.arange(3.0))
    with pytest.raises(KeyError, match="no item 'modle'"):
        export_hf(tmp_path / "c", "modle", tmp_path / "x")


class _RemoteLikeStorage(LocalFileSystemStorage):
    """The local disk seen as an object store: no local path (so no mmap), every ranged read counted."""

    def __init__(self) -> None:
        super().__init__(LocalFileSystemStorageConfig())
        self.range_bytes = 0

    def local_path(self, path: Path) -> str | None:
        return None

    def read_range(self, path: Path, offset: int, length: int) -> bytes:
        self.range_bytes += length
        return super().read_range(path, offset, length)


def test_export_from_a_store_without_local_paths_fetches_each_tensor_once(tmp_path: Path) -> None:
    items = {"weights": ItemSpec(layout=LayoutInfo("w.safetensors", SafetensorsSerialization()))}
    weights = {f"t{i}": torch.full((256, 256), float(i)) for i in range(4)}
    with _manager(**items) as m:
        m.save(str(tmp_path / "c"), {"weights": weights})
    storage = _RemoteLikeStorage()
    export_hf(tmp_path / "c", "weights", tmp_path / "w", storage=storage)
    assert all(torch.equal(_load_all(tmp_path / "w")[k], v) for k, v in weights.items())
    data = sum(v.numel() * v.element_size() for v in weights.values())
    assert data <= storage.range_bytes <= 1.1 * data  # plans come from the header; each tensor is read once


def test_import_round_trip_and_mismatches(tmp_path: Path) -> None:
    sd = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}
    with _manager() as m:
        m.save(str(tmp_path / "c"), {"model": sd})
    export_hf(tmp_path / "c", "model", tmp_path / "hf", max_shard_size=500)
    template = {k: torch.zeros_like(v) for k, v in sd.items()}
    keep = template["embed.weight"]
    assert import_hf(tmp_path / "hf", into=template) is template
    assert template["embed.weight"] is keep and all(torch.equal(template[k], sd[k]) for k in sd)
    flat = import_hf(tmp_path / "hf")
    assert set(flat) == set(sd)
    with pytest.raises(TemplateMismatchError, match=r"embed\.weight"):
        import_hf(tmp_path / "hf", into={"embed.weight": torch.zeros(49, 8)})
    with pytest.raises(TemplateMismatchError, match="missing"):
        import_hf(tmp_path / "hf", into={"missing": torch.zeros(1)})
    single = tmp_path / "single"
    single.mkdir()
    save_file({"x": torch.ones(2)}, str(single / "model.safetensors"))
    assert torch.equal(import_hf(single, into={"x": torch.zeros(2)})["x"], torch.ones(2))


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_names_tensors_by_their_stored_dotted_keys(tmp_path: Path, fmt: str) -> None:
    # Keys that begin with a dot or are empty do not split back into their path: export reads them by the key
    # the file stores, named exactly as the safetensors encoder names them.
    items = {"m": ItemSpec(layout=LayoutInfo("m.safetensors", SafetensorsSerialization()))} if fmt != "torch" else {}
    value = {".hidden": torch.ones(2), "": {"x": torch.arange(3.0)}, "a": {"": torch.zeros(1)}}
    with _manager(**items) as m:
        m.save(str(tmp_path / "c"), {"m": value})
    export_hf(tmp_path / "c", "m", tmp_path / "hf")
    got = _load_all(tmp_path / "hf")
    assert set(got) == {".hidden", "x", "a."}
    assert torch.equal(got[".hidden"], torch.ones(2)) and torch.equal(got["x"], torch.arange(3.0))


def test_import_fills_tensors_inside_tuples_and_any_mapping(tmp_path: Path) -> None:
    # Before: the template walk descended into dicts and lists only, so tensors in a tuple were left untouched
    # without a word.
    from types import MappingProxyType

    save_file({"layers.0": torch.ones(2), "layers.1": torch.full((2,), 2.0)}, str(tmp_path / "model.safetensors"))
    template = MappingProxyType({"layers": (torch.zeros(2), torch.zeros(2))})
    import_hf(tmp_path, into=template)
    assert torch.equal(template["layers"][0], torch.ones(2)) and torch.equal(
        template["layers"][1], torch.full((2,), 2.0)
    )


# ------------------------------------------------------------------------------------------------- two ranks

FULL = {
    "rows": torch.arange(35.0).reshape(5, 7),  # 5 rows over 2 ranks: uneven Shard(0)
    "cols": torch.arange(24.0).reshape(4, 6),
    "strided": torch.arange(48.0).reshape(8, 6),
    "rep": torch.arange(3.0),
}


def _placements() -> dict[str, list[Any]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "rows": [Shard(0)],
        "cols": [Shard(1)],
        "strided": [_StridedShard(0, split_factor=2)],
        "rep": [Replicate()],
    }


def hf_two_ranks(root: str) -> dict[str, Any]:
    """Rank function: save DTensors (incl. _StridedShard) and a per-rank plain item; import HF into DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    model = {k: distribute_tensor(FULL[k], mesh, p) for k, p in _placements().items()}
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = {"model": ItemSpec(resharder=DTensorResharder())}
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(cfg) as m:
        m.save(f"{root}/ckpt", {"model": model, "local": {"t": torch.full((2,), float(rank))}})
    if rank == 0:
        Path(f"{root}/hf_in").mkdir()
        save_file({k: v.contiguous() for k, v in FULL.items()}, f"{root}/hf_in/model.safetensors")
    dist.barrier()
    template = {k: distribute_tensor(torch.zeros_like(FULL[k]), mesh, p) for k, p in _placements().items()}
    import_hf(f"{root}/hf_in", into=template)
    ok = {k: bool(torch.equal(template[k].full_tensor(), FULL[k])) for k in FULL}
    return {"rank": rank, "import_ok": ok}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from simulator.launcher import launch

    root = tmp_path_factory.mktemp("hf2")
    return root, launch(hf_two_ranks, 2, args=(str(root),), timeout=240)


@pytest.mark.multirank
def test_export_consolidates_dtensor_shards_of_any_placement(
    two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, _ = two_ranks
    export_hf(root / "ckpt", "model", tmp_path / "hf", max_shard_size=200)
    got = _load_all(tmp_path / "hf")
    assert set(got) == set(FULL)
    for k, v in FULL.items():
        assert torch.equal(got[k], v), k
    assert {n: t.shape for n, t in iter_item_tensors(root / "ckpt", "model")} == {k: v.shape for k, v in FULL.items()}


@pytest.mark.multirank
def test_per_rank_items_without_metadata_need_a_rank(
    two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, _ = two_ranks
    with pytest.raises(ValueError, match="per-rank files without sharding metadata"):
        export_hf(root / "ckpt", "local", tmp_path / "x")
    export_hf(root / "ckpt", "local", tmp_path / "r1", rank=1)
    assert torch.equal(_load_all(tmp_path / "r1")["t"], torch.full((2,), 1.0))


@pytest.mark.multirank
def test_import_fills_dtensor_templates_with_their_local_shards(two_ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = two_ranks
    for r in results:
        assert all(r["import_ok"].values()), r


def _craft_global_shape(src: Path, dst: Path, name: str, shape: list[int]) -> None:
    """Copy a checkpoint and rewrite one tensor's `global_shape` in metadata.json, with the manifest's record
    of that file updated to match (what a crafted checkpoint has)."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "metadata.json").read_text())
    groups = doc["metadata"]["model"]["nested_path_to_metadata"][json.dumps([name])]
    groups[0]["sharding_metadata"]["data"]["global_shape"] = shape
    raw = json.dumps(doc).encode()
    (dst / "metadata.json").write_bytes(raw)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["metadata_crc32"], manifest["metadata_size"] = zlib.crc32(raw), len(raw)
    (dst / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("rows", [2**40, 7]),  # 30 TB: the allocation itself failed (RuntimeError), before any refusal
        ("cols", [4, 2**40]),
        ("strided", [2**40, 6]),
        ("rep", [2**40]),
        ("rows", [1, 7]),  # smaller than saved: a truncated tensor was exported as if it were whole
    ],
)
def test_export_refuses_a_crafted_global_shape_before_allocating(
    two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path, name: str, shape: list[int]
) -> None:
    root, _ = two_ranks
    crafted = tmp_path / "crafted"
    _craft_global_shape(root / "ckpt", crafted, name, shape)
    with pytest.raises(CorruptCheckpointError, match=rf"metadata\.json.*global_shape.*model::{name}") as info:
        export_hf(crafted, "model", tmp_path / "hf")
    assert "model_0.pt" in str(info.value)
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if ".export-tmp-" in p.name]


@pytest.mark.multirank
def test_export_refuses_a_global_shape_of_another_rank_count_at_parse(
    two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """A 3-D global shape over 2-D shards disagrees with the tensor's own stride: refused as the metadata is
    parsed, naming metadata.json, the item, the path and the field, before any file is read or written."""
    root, _ = two_ranks
    crafted = tmp_path / "crafted"
    _craft_global_shape(root / "ckpt", crafted, "rows", [5, 7, 3])
    with pytest.raises(CorruptCheckpointError, match=r"""metadata\.json.*item 'model' path \["rows"\].*'stride'"""):
        export_hf(crafted, "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if ".export-tmp-" in p.name]
