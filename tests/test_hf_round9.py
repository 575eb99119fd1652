"""HF export under attack: every value a training checkpoint holds, read back by safetensors' own loader bit for
bit or refused naming the key; the index checked against the Hugging Face sharded layout; bad arguments and
unwritable outputs refused before anything is written."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.errors import ConfigError, TemplateMismatchError
from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf, import_hf, iter_item_tensors, parse_size
from torch_checkpointing.safetensors_tree import stores_dtype
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

SUBPROCESS_TIMEOUT_S = 180
SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _manager(fmt: str) -> CheckpointManager:
    cfg = CheckpointManager.Config.with_sync_save()
    if fmt == "safetensors":
        cfg.items = {"m": ItemSpec(layout=LayoutInfo("m.safetensors", SafetensorsSerialization()))}
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(cfg)


def _save(root: Path, value: Any, fmt: str = "torch") -> Path:
    with _manager(fmt) as m:
        m.save(str(root / "c"), {"m": value})
    return root / "c"


def _read_export(out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The index and every tensor, read by safetensors' own loader; checks the layout on the way: shard names
    in HF's pattern and numbered 1..n, every name in exactly one shard (the one the index says), `format: pt`."""
    index = json.loads((out / INDEX_FILE_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    numbers = [SHARD_NAME.match(s) for s in shards]
    assert all(numbers), shards
    assert [int(n[1]) for n in numbers if n] == list(range(1, len(shards) + 1))
    assert {int(n[2]) for n in numbers if n} == {len(shards)}
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors")) == shards  # none unindexed
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, shard
        tensors = load_file(str(out / shard))
        assert not set(tensors) & set(got), shard  # a name in two shards
        assert all(index["weight_map"][k] == shard for k in tensors)
        got.update(tensors)
    assert set(got) == set(index["weight_map"])
    return index, got


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_exact(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), name
    assert _bits(got) == _bits(want), name


def _nothing_left(root: Path, keep: set[str]) -> None:
    assert {p.name for p in root.iterdir()} == keep


# ------------------------------------------------------------------------------------------------ values


def _every_dtype() -> dict[str, torch.Tensor]:
    """One tensor per dtype the installed safetensors stores (asked of it), with bit patterns that a cast
    through another dtype would change (NaN payloads, negative zero, extremes)."""
    g = torch.Generator().manual_seed(9)
    out: dict[str, torch.Tensor] = {}
    for dtype in [getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)]:
        name = str(dtype).removeprefix("torch.")  # aliases (torch.float, torch.half) give one name
        if not stores_dtype(dtype) or name in out:
            continue
        size = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (6 * size,), dtype=torch.uint8, generator=g)
        value = torch.tensor([0, 1, 0, 1, 1, 0], dtype=torch.bool) if dtype == torch.bool else raw.view(dtype)
        out[name] = value.reshape(2, 3)
    return out


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_every_safetensors_dtype_exports_bit_for_bit(tmp_path: Path, fmt: str) -> None:
    value = _every_dtype()
    assert {"bfloat16", "float16", "float64", "int8", "uint8", "bool", "float8_e4m3fn"} <= set(value)
    _save(tmp_path, value, fmt)
    index, got = _read_export_of(tmp_path, max_shard_size=40)
    for name, want in value.items():
        _assert_exact(got[name], want, name)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in value.values())


def _read_export_of(root: Path, **kwargs: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    export_hf(root / "c", "m", root / "hf", **kwargs)
    return _read_export(root / "hf")


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_odd_shapes_views_and_tied_weights_export_exactly(tmp_path: Path, fmt: str) -> None:
    """Zero-dim, zero-size, transposed and sliced views of a larger storage, and one tensor under two names
    (tied embeddings). Tied weights are stored once per name: a shard holds each name `load_file` gives back
    (`safetensors.torch.save_model` instead drops one name and needs `load_model` to tie it again, which a
    flat export cannot do), and `total_size` counts the bytes stored, as HF sums the shards' tensors."""
    big = torch.arange(120.0).reshape(10, 12)
    tied = torch.randn(6, 4)
    value = {
        "scalar": torch.tensor(-0.0),
        "empty": torch.empty(0, 5),
        "empty_int": torch.empty(3, 0, dtype=torch.int32),
        "transposed": big.t(),
        "column": big[:, 3],
        "embed.weight": tied,
        "lm_head.weight": tied,
        "rows": tied[2:],
    }
    _save(tmp_path, value, fmt)
    index, got = _read_export_of(tmp_path, max_shard_size=100)
    for name, want in value.items():
        _assert_exact(got[name], want, name)
    assert got["embed.weight"].data_ptr() != got["lm_head.weight"].data_ptr()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in value.values())


@pytest.mark.parametrize(
    ("value", "paths"),
    [
        ({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "('a.b',) and ('a', 'b')"),
        ({"layers.0": torch.ones(2), "layers": [torch.zeros(2)]}, "('layers.0',) and ('layers', 0)"),
        ({1: torch.ones(2), "1": torch.zeros(2)}, "(1,) and ('1',)"),
    ],
)
def test_two_tensors_of_one_dotted_name_are_refused_naming_both_paths(
    tmp_path: Path, value: dict[Any, Any], paths: str
) -> None:
    """A Torch item keeps both tensors; the export flattened them to one name and silently kept only one."""
    _save(tmp_path, value)
    with pytest.raises(ValueError, match=re.escape(paths) + ".*one tensor per name"):
        export_hf(tmp_path / "c", "m", tmp_path / "hf")
    _nothing_left(tmp_path, {"c"})


def test_an_empty_key_beside_the_item_keys_name_is_refused(tmp_path: Path) -> None:
    """A tensor under the empty key is exported under the item key's name (HF needs a name): beside a tensor
    already of that name, one of them was silently left out."""
    _save(tmp_path, {"": torch.ones(2), "m": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"paths \(\) and \('m',\).*name 'm'.*one tensor per name"):
        export_hf(tmp_path / "c", "m", tmp_path / "hf")
    _nothing_left(tmp_path, {"c"})


def test_a_tensor_beside_a_non_tensor_of_its_name_exports_the_tensor(tmp_path: Path) -> None:
    """Only tensors go into the export: a step count whose dotted name a tensor also has is not a collision."""
    _save(tmp_path, {"a.b": torch.ones(2), "a": {"b": 3}})
    _, got = _read_export_of(tmp_path)
    assert set(got) == {"a.b"} and torch.equal(got["a.b"], torch.ones(2))


def test_a_tensor_named_like_the_header_metadata_is_refused_before_writing(tmp_path: Path) -> None:
    """`__metadata__` is safetensors' header entry: the export wrote the shard, and every load of it failed
    ("duplicate field `__metadata__`")."""
    _save(tmp_path, {"w": torch.ones(2), "__metadata__": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"\('__metadata__',\).*reserves.*Rename"):
        export_hf(tmp_path / "c", "m", tmp_path / "hf")
    _nothing_left(tmp_path, {"c"})


def test_non_tensor_leaves_are_left_out_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    value = {"w": torch.ones(2), "step": 7, "opt": {"lr": 0.1, "betas": (0.9, 0.99)}, "name": "run1"}
    _save(tmp_path, value)
    with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
        _, got = _read_export_of(tmp_path)
    assert set(got) == {"w"}
    lines = [r.getMessage() for r in caplog.records if "non-tensor" in r.getMessage()]
    assert len(lines) == 1 and "5 non-tensor leaves" in lines[0] and "'opt.betas.1'" in lines[0], lines


# ------------------------------------------------------------------------------------------------ the index


def test_shards_respect_the_size_limit_as_hf_computes_it(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    value = {f"w{i:02d}": torch.randn(int(torch.randint(1, 60, (1,), generator=g)), generator=g) for i in range(30)}
    value["huge"] = torch.randn(400, generator=g)  # 1600 bytes, past the limit
    value["after"] = torch.randn(3, generator=g)
    _save(tmp_path, value)
    index, got = _read_export_of(tmp_path, max_shard_size="200B")
    for name, want in value.items():
        _assert_exact(got[name], want, name)
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    sizes = {s: sum(got[n].numel() * got[n].element_size() for n in names) for s, names in by_shard.items()}
    stored = {k: v.numel() * v.element_size() for k, v in value.items()}
    assert stored["huge"] > 200 and by_shard[index["weight_map"]["huge"]] == ["huge"]
    for shard, names in by_shard.items():  # past the limit only as a lone tensor larger than it
        assert sizes[shard] <= 200 or (len(names) == 1 and stored[names[0]] > 200), (shard, names)
    assert index["metadata"]["total_size"] == sum(stored.values())


def test_a_tensor_past_the_limit_gets_its_own_shard_and_the_open_one_stays_open(tmp_path: Path) -> None:
    """huggingface_hub's split (what save_pretrained uses), worked by hand for a 200-byte limit: 80 + 80 fill
    one shard, the next 80 opens a second, the 400-byte tensor takes a shard of its own while the second stays
    open, and the last 32 bytes join it. The old split closed the open shard at the large tensor (4 shards)."""
    sizes = {"a1": 20, "a2": 20, "a3": 20, "a4": 100, "a5": 8}  # float32 elements
    value = {name: torch.ones(n) for name, n in sizes.items()}
    _save(tmp_path, value)
    index, _ = _read_export_of(tmp_path, max_shard_size="200B")
    assert [name for name, _ in iter_item_tensors(tmp_path / "c", "m")] == list(value)  # the order worked above
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    assert sorted(sorted(names) for names in by_shard.values()) == [["a1", "a2"], ["a3", "a5"], ["a4"]]
    assert len(by_shard) == 3 and index["metadata"]["total_size"] == 4 * sum(sizes.values())


@pytest.mark.parametrize("size", [0, -5, "0B", "-1KB", "lots"])
def test_a_shard_size_that_is_not_positive_is_refused(tmp_path: Path, size: int | str) -> None:
    """0 and negative sizes were taken (every tensor then got a shard of its own, without a word)."""
    _save(tmp_path, {"w": torch.ones(2), "v": torch.ones(2)})
    with pytest.raises(ConfigError, match="size"):
        export_hf(tmp_path / "c", "m", tmp_path / "hf", max_shard_size=size)
    _nothing_left(tmp_path, {"c"})
    assert parse_size("1B") == 1


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.complex64, "bfloat16"])
def test_a_cast_to_a_non_floating_dtype_is_refused(tmp_path: Path, dtype: Any) -> None:
    """dtype=torch.int32 cast every float weight to integers (truncating them), and wrote that as the model."""
    _save(tmp_path, {"w": torch.tensor([0.5, 1.7]), "ids": torch.arange(2)})
    with pytest.raises(ConfigError, match="not a floating-point torch dtype"):
        export_hf(tmp_path / "c", "m", tmp_path / "hf", dtype=dtype)
    _nothing_left(tmp_path, {"c"})


# ------------------------------------------------------------------------------------------------ the output

UNPRIVILEGED_EXPORT = """
import os, sys, tempfile
from torch_checkpointing.hf import export_hf
export_hf(sys.argv[1], "m", os.path.join(tempfile.mkdtemp(), "warm"))  # imports everything while root can
os.setgid(65534)
os.setuid(65534)
try:
    export_hf(sys.argv[1], "m", sys.argv[2])
except OSError as exc:
    print(type(exc).__name__, exc, flush=True)
"""


def test_a_parent_that_is_a_file_is_named_with_the_fix(tmp_path: Path) -> None:
    _save(tmp_path, {"w": torch.ones(2)})
    (tmp_path / "notes").write_text("mine")
    with pytest.raises(FileExistsError, match=r"staging folder beside .*notes/hf.*nothing was exported"):
        export_hf(tmp_path / "c", "m", tmp_path / "notes" / "hf")
    assert (tmp_path / "notes").read_text() == "mine"


@pytest.fixture
def world_readable_dir() -> Iterator[Path]:
    """A fresh folder an unprivileged user can reach (pytest's own temporary root is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="hf-round9-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


@pytest.mark.skipif(not hasattr(os, "setuid") or os.geteuid() != 0, reason="drops root to an unprivileged user")
@pytest.mark.parametrize("out_exists", [False, True])
def test_a_read_only_parent_is_refused_naming_the_output(world_readable_dir: Path, out_exists: bool) -> None:
    """Run as an unprivileged user (root ignores permissions): the export needs to write beside its output.
    Before, a bare PermissionError named only the hidden staging folder."""
    tmp_path = world_readable_dir
    _save(tmp_path, {"w": torch.ones(2)})
    for p in [tmp_path / "c", *(tmp_path / "c").rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    parent = tmp_path / "ro"
    out = parent / "hf"
    if out_exists:
        out.mkdir(parents=True)
        os.chmod(out, 0o777)  # the output folder itself is writable; its parent is not
    else:
        parent.mkdir()
    os.chmod(parent, 0o555)
    proc = subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED_EXPORT, str(tmp_path / "c"), str(out)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.stdout.startswith("PermissionError"), proc.stdout + proc.stderr
    assert f"beside {out} " in proc.stdout and f"so {parent} must be a directory you can write" in proc.stdout
    assert sorted(os.listdir(parent)) == (["hf"] if out_exists else [])
    assert not out_exists or os.listdir(out) == []


FSIZE_EXPORT = """
import resource, signal, sys
from torch_checkpointing.hf import export_hf
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))
try:
    export_hf(sys.argv[1], "m", sys.argv[2], max_shard_size="20KB")
except OSError as exc:
    print("FAILED", exc, flush=True)
"""


def test_a_full_disk_on_a_fresh_output_leaves_nothing_that_looks_like_an_export(tmp_path: Path) -> None:
    """Two small tensors fit under the file-size limit, the 256 KiB one does not: no output folder, no
    staging, and the error names the shard."""
    _save(tmp_path, {"a": torch.zeros(8), "b": torch.ones(8), "big": torch.zeros(64 * 1024)})
    proc = subprocess.run(
        [sys.executable, "-c", FSIZE_EXPORT, str(tmp_path / "c"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    # The OS error's errno comes with it (safetensors keeps it only in its text).
    assert proc.stdout.startswith(f"FAILED [Errno {errno.EFBIG}] Could not write export shard model-0000"), (
        proc.stdout + proc.stderr
    )
    assert "nothing was exported" in proc.stdout
    _nothing_left(tmp_path, {"c"})


# ------------------------------------------------------------------------------------------------ two ranks


def _dtensor_values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4, 7, generator=g).half(),
        "f64": torch.randn(3, generator=g).double(),
        "i8": torch.randint(-128, 127, (6, 2), dtype=torch.int8, generator=g),
        "u8": torch.randint(0, 255, (3, 4), dtype=torch.uint8, generator=g),
        "mask": torch.randint(0, 2, (7,), generator=g).bool(),
        "f8": torch.randint(0, 256, (4, 4), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn),
        "empty": torch.empty(0, 4),
    }


def _dtensor_placements() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard

    return {"bf16": Shard(0), "f16": Shard(1), "f64": Shard(0), "i8": Shard(0), "u8": Shard(1), "mask": Shard(0),
            "f8": Shard(0), "empty": Replicate()}  # fmt: skip


def _local_dtensor(full: torch.Tensor, mesh: Any, placement: Any) -> Any:
    """This rank's part of `full` as a DTensor, cut here: gloo's scatter (distribute_tensor) has no bool or
    float8 type."""
    from torch.distributed.tensor import DTensor, Shard

    local, rank = full, dist.get_rank()
    if isinstance(placement, Shard):  # torch's Shard cuts as chunk() does: uneven, the last part the smaller
        parts = full.chunk(2, placement.dim)
        local = parts[rank] if rank < len(parts) else full.narrow(placement.dim, 0, 0)
    return DTensor.from_local(local.contiguous(), mesh, [placement], run_check=False, shape=full.shape,
                              stride=full.stride())  # fmt: skip


def hf_round9_two_ranks(root: str) -> int:
    """Rank function: DTensors of many dtypes, and an item whose two DTensors flatten to one name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (2,))
    values, placements = _dtensor_values(), _dtensor_placements()
    model: dict[str, Any] = {k: _local_dtensor(v, mesh, placements[k]) for k, v in values.items()}
    model["step"] = 100  # a non-tensor leaf beside them
    clash = {
        "a.b": _local_dtensor(torch.ones(4), mesh, Shard(0)),
        "a": {"b": _local_dtensor(torch.zeros(4), mesh, Shard(0))},
    }
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = {"model": ItemSpec(resharder=DTensorResharder()), "clash": ItemSpec(resharder=DTensorResharder())}
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(cfg) as m:
        m.save(f"{root}/ckpt", {"model": model, "clash": clash})
    dist.barrier()
    return dist.get_rank()


@pytest.fixture(scope="module")
def two_rank_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from simulator.launcher import launch

    root = tmp_path_factory.mktemp("hf9")
    assert launch(hf_round9_two_ranks, 2, args=(str(root),), timeout=240) == [0, 1]
    return root / "ckpt"


@pytest.mark.multirank
def test_dtensors_of_every_dtype_saved_by_two_ranks_export_from_the_cli(two_rank_ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "torch_checkpointing", "export", str(two_rank_ckpt), "--item", "model"]
    proc = subprocess.run(
        [*cmd, "--to", "hf", str(out), "--max-shard-size", "64B", "--json"],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index, got = _read_export(out)
    values = _dtensor_values()
    assert set(got) == set(values)
    for name, want in values.items():
        _assert_exact(got[name], want, name)
    assert (
        index["metadata"]["total_size"]
        == json.loads(proc.stdout)["total_bytes"]
        == sum(t.numel() * t.element_size() for t in values.values())
    )


@pytest.mark.multirank
def test_two_dtensors_of_one_dotted_name_are_refused(two_rank_ckpt: Path, tmp_path: Path) -> None:
    """Both were planned under 'a.b' from metadata.json: one shard file got one of them, the index one name."""
    with pytest.raises(ValueError, match=r"\('a\.b',\) and \('a', 'b'\).*one tensor per name"):
        export_hf(two_rank_ckpt, "clash", tmp_path / "hf")
    _nothing_left(tmp_path, set())


@pytest.mark.parametrize("where", ["step_1", "step_1/hf", "step_1/a/b"])
def test_an_output_inside_another_checkpoint_is_refused(tmp_path: Path, where: str) -> None:
    """Into step_1 (another committed checkpoint) or a folder under it: the export was written there, and from
    then on `prune` could never delete step_1 ("it also holds files that are not part of it")."""
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(cfg) as m:
        for step in (1, 2):
            m.save(str(tmp_path / f"step_{step}"), {"m": {"w": torch.full((2,), float(step))}})
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=r"lies inside the checkpoint .*step_1: .*retention"):
        export_hf(tmp_path / "step_2", "m", tmp_path / where)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_an_output_beside_another_tools_manifest_is_not_a_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, {"w": torch.ones(2)})
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "manifest.json").write_text('{"name": "a web app", "version": "1"}')
    _, got = _read_export_of_into(tmp_path, tmp_path / "app" / "hf")
    assert torch.equal(got["w"], torch.ones(2))


def _read_export_of_into(root: Path, out: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    export_hf(root / "c", "m", out)
    return _read_export(out)


@pytest.mark.parametrize("value", [torch.arange(3.0), {"": torch.arange(3.0), "b": torch.ones(2)}], ids=["bare", "key"])
def test_import_of_an_empty_named_tensor_names_the_item_key_it_was_exported_under(tmp_path: Path, value: Any) -> None:
    """Export names the empty-named tensor by the item key; importing into the saved structure said only "has
    no tensor(s) ['']". Now the error says why, and the template holding it under the item key round-trips."""
    _save(tmp_path, value)
    export_hf(tmp_path / "c", "m", tmp_path / "hf")
    same_shape = torch.zeros(3) if isinstance(value, torch.Tensor) else {"": torch.zeros(3), "b": torch.zeros(2)}
    with pytest.raises(TemplateMismatchError, match=r"empty name.*item's key.*'<item key>'.*'m'") as info:
        import_hf(tmp_path / "hf", into=same_shape)
    assert str(tmp_path / "hf") in str(info.value)
    keyed = {"m": torch.zeros(3)} if isinstance(value, torch.Tensor) else {"m": torch.zeros(3), "b": torch.zeros(2)}
    import_hf(tmp_path / "hf", into=keyed)
    assert torch.equal(keyed["m"], torch.arange(3.0))
