"""HF export attacked as a user and as an attacker (round 16): the files an export hands to other tools, and an
overwrite killed while it moves its files in."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager
from torch_checkpointing.errors import ConfigError, CorruptCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf, import_hf

SUBPROCESS_TIMEOUT_S = 120


def _save(path: Path, model: dict[str, torch.Tensor]) -> Path:
    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(path), {"model": model})
    return path


def test_every_exported_file_is_as_readable_as_the_umask_allows(tmp_path: Path) -> None:
    """Defect: safetensors' `save_file` creates its file mode 0600, so an export's shards were readable by their
    owner only while its index (and the checkpoint it came from) followed the umask: a serving job of another
    user, or a teammate reading a group-shared folder, got the index and "Permission denied" on every shard.
    (operations.md: "give a model to Hugging Face tools")."""
    ckpt = _save(tmp_path / "ckpt", {"w": torch.randn(4, 4), "b": torch.randn(4)})
    old = os.umask(0o022)
    try:
        export_hf(ckpt, "model", tmp_path / "hf", max_shard_size=64)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert len(modes) == 3, modes  # two shards and the index
    assert modes == dict.fromkeys(modes, 0o644), {k: oct(v) for k, v in modes.items()}


_OVERWRITE = """
import sys
from torch_checkpointing.hf import export_hf
export_hf(sys.argv[1], "model", sys.argv[2], max_shard_size=4, overwrite=True)
"""


def _stop_mid_publish(ckpt: Path, out: Path, first_new: str) -> bool:
    """Run an overwriting export of `ckpt` into `out` as a child, SIGSTOP it the moment its first shard has
    moved in (its publish under way), and leave it stopped; False if it finished before it could be stopped."""
    child = subprocess.Popen([sys.executable, "-c", _OVERWRITE, str(ckpt), str(out)])
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while not os.path.lexists(out / first_new):
            assert child.poll() is None, f"the export ended (rc {child.returncode}) before it published"
            assert time.monotonic() < deadline, "the export never published"
        stop(child.pid)
        return child.poll() is None
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=SUBPROCESS_TIMEOUT_S)


def test_an_overwrite_killed_while_moving_in_leaves_a_whole_export(tmp_path: Path) -> None:
    """Spec (operations.md, All or nothing): "a failed export (... a kill) never leaves a directory that looks
    like a complete export, and an earlier export there stays whole". Defect: an overwrite removed the earlier
    export's index before moving its first shard in, so a SIGKILL during the moves destroyed the earlier export
    even when no new shard takes an old one's name; now the new index replaces the old in one rename, after the
    new shards, and the folder holds one whole export, the old or the new, at every instant."""
    old_values = {"w": torch.arange(8.0)}
    export_hf(_save(tmp_path / "old", old_values), "model", tmp_path / "hf")  # one shard: model-00001-of-00001
    n = 1500  # one 4-byte tensor per shard: 1500 renames to be stopped among
    new_values = {f"t{i:04d}": torch.full((1,), float(i)) for i in range(n)}
    new = _save(tmp_path / "new", new_values)
    (tmp_path / "hf" / "config.json").write_text("{}")
    stopped = _stop_mid_publish(new, tmp_path / "hf", f"model-00001-of-{n:05d}.safetensors")
    assert stopped, "the export finished before it was stopped: nothing was tested"
    back = import_hf(tmp_path / "hf")  # as the kill left it
    want = old_values if set(back) == set(old_values) else new_values
    assert set(back) == set(want), sorted(back)[:5]
    assert all(torch.equal(back[k], v) for k, v in want.items())
    assert (tmp_path / "hf" / "config.json").read_text() == "{}"


def test_a_stale_single_file_goes_before_the_new_index_lands(tmp_path: Path) -> None:
    """transformers reads `model.safetensors` before an index: an overwrite that moved its index in beside a
    stale single-file export still there would hand transformers the old weights. The overwrite leaves no
    `model.safetensors` beside its index (checked on the finished export)."""
    from safetensors.torch import save_file

    out = tmp_path / "hf"
    out.mkdir()
    save_file({"w": torch.zeros(2)}, str(out / "model.safetensors"))
    export_hf(_save(tmp_path / "c", {"w": torch.ones(2)}), "model", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00001.safetensors", INDEX_FILE_NAME]
    assert torch.equal(import_hf(out)["w"], torch.ones(2))


def test_an_export_to_the_file_system_root_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """Defect: `export ... /` failed with Python's "PosixPath('/') has an empty name" (a ValueError from inside
    pathlib, naming neither the output nor the fix). An output folder needs a parent to be staged beside."""
    ckpt = _save(tmp_path / "c", {"w": torch.ones(2)})
    with pytest.raises(ConfigError, match=r"output '/'.*a folder of its own"):
        export_hf(ckpt, "model", "/")


def round16_two_ranks(root: str) -> int:
    """Rank function: one DTensor sharded over two ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torch_checkpointing import ItemSpec
    from torch_checkpointing.dtensor_resharder import DTensorResharder

    mesh = init_device_mesh("cpu", (2,))
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = {"model": ItemSpec(resharder=DTensorResharder())}
    with CheckpointManager(cfg) as manager:
        manager.save(
            f"{root}/ckpt", {"model": {"w": distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])}}
        )
    dist.barrier()
    return dist.get_rank()


@pytest.mark.multirank
def test_a_rank_file_the_manifest_does_not_list_is_refused_as_crafted(tmp_path: Path, mesh: Any) -> None:
    """Spec (operations.md, Crafted checkpoints): export opens "only files the manifest lists" and stops "naming
    the file". Defect: a manifest with rank 1's record removed (its file still there, named by metadata.json)
    failed with FileNotFoundError "... model_1.pt ... does not exist", a false reason and not a
    CorruptCheckpointError, so a script could not tell a crafted checkpoint from a missing one."""
    from simulator.launcher import launch

    assert launch(round16_two_ranks, 2, args=(str(tmp_path),), timeout=SUBPROCESS_TIMEOUT_S) == [0, 1]
    manifest_path = tmp_path / "ckpt" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["items"]["model"]["1"]
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"names model_1\.pt as rank 1's file of item 'model'"):
        export_hf(tmp_path / "ckpt", "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    _a_resharding_load_refuses_the_unlisted_file(tmp_path / "ckpt", mesh)


def _a_resharding_load_refuses_the_unlisted_file(ckpt: Path, mesh: Any) -> None:
    """The same crafted checkpoint, loaded resharded on one rank (the launch is shared): the load said "Source
    file .../model_1.pt named by the checkpoint's sharding metadata does not exist", false for a file that is
    there; the read context's own reason (not listed in the manifest, never read) is the one to give."""
    from torch.distributed.tensor import DTensor, Replicate

    from torch_checkpointing import ItemSpec, UnsafeCheckpointError
    from torch_checkpointing.dtensor_resharder import DTensorResharder

    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = {"model": ItemSpec(resharder=DTensorResharder())}
    template = DTensor.from_local(torch.zeros(4, 2), mesh, [Replicate()])
    with CheckpointManager(cfg) as manager, pytest.raises(UnsafeCheckpointError) as caught:
        manager.load(str(ckpt), into={"model": {"w": template}})
    said = str(caught.value)
    assert "model_1.pt" in said and "not listed in the checkpoint's manifest" in said, said
    assert "does not exist" not in said, said
    assert torch.equal(template.to_local(), torch.zeros(4, 2))


def test_a_crafted_stride_zero_tensor_is_refused_before_it_is_written_dense(tmp_path: Path) -> None:
    """Spec (brief: a crafted source checkpoint is refused with a CorruptCheckpointError naming the file).
    Defect: a Torch item file holding `torch.zeros(1).expand(2**13, 2**14)` (1.5 KB on disk, checksums made to
    match) exported as a 512 MiB shard: the export writes every tensor dense, so a few bytes of checkpoint
    asked for any amount of memory and disk. No save of ours writes a stride-0 view (they are stored dense)."""
    import zlib

    from torch_checkpointing.checksum import block_crc32s

    ckpt = _save(tmp_path / "c", {"e": torch.zeros(1)})
    torch.save({"e": torch.zeros(1).expand(2**13, 2**14)}, ckpt / "model_0.pt")
    data = (ckpt / "model_0.pt").read_bytes()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    record = manifest["items"]["model"]["0"]
    record["size"], record["crc32"] = len(data), zlib.crc32(data)
    crcs = block_crc32s(memoryview(data), record["blocks"]["block_size"])
    record["blocks"]["crc32"] = "".join(f"{c:08x}" for c in crcs)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"model_0\.pt is damaged or crafted: the tensor at path \('e',\)"):
        export_hf(ckpt, "model", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
