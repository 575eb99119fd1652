"""The operations CLI, run as a subprocess (and in-process for the cheap cases) on checkpoints the public API made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.checkpoint_layout import JsonSerialization, LayoutInfo, SafetensorsSerialization
from torch_checkpointing.cli import main
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

REPO = Path(__file__).resolve().parents[1]


def _manager(**items: ItemSpec) -> CheckpointManager:
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = items
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(cfg)


def _cli(*args: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("torch-checkpointing") if script else None
    cmd = [exe] if exe else [sys.executable, "-m", "torch_checkpointing"]
    # stdout is a pipe, not a terminal: the output must be plain text (or JSON) all the same.
    return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("cli")
    items = {
        "weights": ItemSpec(layout=LayoutInfo("weights.safetensors", SafetensorsSerialization())),
        "misc": ItemSpec(requires_copy=False, layout=LayoutInfo("misc.json", JsonSerialization())),
    }
    with _manager(**items) as m:
        for step in (1, 2):
            model = {"w": torch.arange(6.0).reshape(2, 3) * step, "b": torch.ones(3), "n": 7}
            payload = {"model": model, "weights": {"e": torch.full((4,), 1.0)}, "misc": {"step": step}}
            m.save(str(base / f"step_{step}"), payload, metrics={"loss": 1.0 / step})
    (base / ".step_3.tmp-0badc0de-9").mkdir()
    (base / "notes").mkdir()
    return base


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    code = main(["--json", *argv])
    return code, json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------- subprocess, one rank


def test_ls_as_a_subprocess_prints_a_plain_table(root: Path) -> None:
    proc = _cli("ls", str(root))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "\x1b[" not in proc.stdout  # no terminal escapes into a pipe
    assert any(line.split()[:2] == ["step_1", "1"] for line in lines)
    assert any(line.split()[:2] == ["step_2", "2"] and "loss=0.5" in line for line in lines)
    assert any(".step_3.tmp-0badc0de-9" in line and "temporary" in line for line in lines)
    assert "notes" not in proc.stdout


def test_verify_json_through_the_console_script_and_a_damaged_file(root: Path, tmp_path: Path) -> None:
    proc = _cli("verify", "--json", str(root / "step_2"), script=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] is True and {f["path"] for f in doc["files"]} == {"model_0.pt", "weights.safetensors", "misc.json"}
    damaged = tmp_path / "damaged"
    shutil.copytree(root / "step_2", damaged)
    data = bytearray((damaged / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (damaged / "weights.safetensors").write_bytes(bytes(data))
    proc = _cli("verify", str(damaged))
    assert proc.returncode == 1
    assert "FAILED weights.safetensors: crc32" in proc.stdout and "2/3" in proc.stdout


def test_verify_names_a_manifest_whose_block_crcs_disagree_with_its_crc(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The data is intact, a block record is not: the CLI says what the loader says (a damaged manifest)."""
    forged = tmp_path / "forged"
    shutil.copytree(root / "step_2", forged)
    doc = json.loads((forged / "manifest.json").read_text())
    rec = doc["items"]["weights"]["0"]
    hexed = rec["blocks"]["crc32"]
    rec["blocks"]["crc32"] = ("0" if hexed[0] != "0" else "1") + hexed[1:]
    (forged / "manifest.json").write_text(json.dumps(doc))
    code, out = _json(capsys, ["verify", str(forged)])
    assert code == 1
    (bad,) = [f for f in out["files"] if not f["ok"]]
    assert bad["path"] == "weights.safetensors" and "manifest record is inconsistent" in bad["problem"]


# ------------------------------------------------------------------------------------------- in-process


def test_ls_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _json(capsys, ["ls", str(root)])
    assert code == 0
    assert [(c["name"], c["step"], c["metrics"]) for c in doc["checkpoints"]] == [
        ("step_1", 1, {"loss": 1.0}),
        ("step_2", 2, {"loss": 0.5}),
    ]
    (leftover,) = doc["leftovers"]
    assert leftover["kind"] == "temporary" and leftover["gc"].startswith("kept: owner unknown")


def test_inspect_lists_items_files_formats_and_metrics(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _json(capsys, ["inspect", str(root / "step_1")])
    assert code == 0
    assert doc["world_size"] == 1 and doc["step"] == 1 and doc["metrics"] == {"loss": 1.0}
    assert {k: v["format"] for k, v in doc["items"].items()} == {
        "misc": "JsonSerialization",
        "model": "TorchSerialization",
        "weights": "SafetensorsSerialization",
    }
    assert doc["items"]["weights"]["files"][0]["size"] == (root / "step_1" / "weights.safetensors").stat().st_size
    assert main(["inspect", str(root / "step_1")]) == 0
    text = capsys.readouterr().out
    assert "weights.safetensors" in text and "loss=1" in text and "single file" in text


def test_diff_names_items_and_max_abs_difference(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _json(capsys, ["diff", str(root / "step_1"), str(root / "step_2")])
    assert code == 1 and doc["identical"] is False
    got = {(d["item"], d["leaf"]): d["detail"] for d in doc["differences"]}
    assert got == {("model", "w"): "max abs diff 5", ("misc", "step"): "1 vs 2"}
    code, doc = _json(capsys, ["diff", str(root / "step_1"), str(root / "step_1")])
    assert code == 0 and doc["identical"] is True


def test_gc_dry_run_then_collect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / ".c.tmp-0badc0de-1").mkdir()
    (tmp_path / ".c.trash-999999999-abcd").mkdir()
    code, doc = _json(capsys, ["gc", str(tmp_path), "--dry-run", "--older-than", "0"])
    assert (
        code == 0
        and len(doc["removed"]) == 2
        and all((tmp_path / Path(d["path"]).name).exists() for d in doc["removed"])
    )
    assert main(["gc", str(tmp_path), "--older-than", "0"]) == 0
    assert "removed 2 leftover(s)" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_prune_keeps_what_the_policy_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _manager() as m:
        for step in range(4):
            m.save(str(tmp_path / f"s{step}"), {"x": step}, metrics={"acc": [0.9, 0.1, 0.5, 0.2][step]})
    code, doc = _json(
        capsys, ["prune", str(tmp_path), "--keep-last", "1", "--keep-best", "1", "--metric", "acc", "--mode", "max"]
    )
    assert code == 0 and [d["name"] for d in doc["deleted"]] == ["s1", "s2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0", "s3"]


def test_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "plain").mkdir()
    assert main(["inspect", str(tmp_path / "plain")]) == 2
    assert "no manifest.json: not a checkpoint" in capsys.readouterr().err
    code, doc = _json(capsys, ["ls", str(tmp_path / "absent")])
    assert code == 2 and "no such directory" in doc["error"]
    assert main(["verify", str(tmp_path / "plain")]) == 1  # verify answers "no" for a non-checkpoint
    with pytest.raises(SystemExit) as exc:
        main(["export", str(tmp_path)])  # --item and --to are required
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------------- two ranks


def save_two_ranks(root: str) -> dict[str, Any]:
    """Rank function: a DTensor model sharded over 2 ranks plus per-rank JSON, saved through the public API."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(30.0).reshape(5, 6)
    model = {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "v": distribute_tensor(full.T.contiguous(), mesh, [Shard(1)]),
        "r": distribute_tensor(torch.ones(3), mesh, [Replicate()]),
    }
    items = {
        "model": ItemSpec(resharder=DTensorResharder()),
        "misc": ItemSpec(requires_copy=False, layout=LayoutInfo("misc_{rank}.json", JsonSerialization())),
    }
    cfg = CheckpointManager.Config.with_async_save()
    cfg.items = items
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(cfg) as m:
        m.save(f"{root}/step_5", {"model": model, "misc": {"rank": dist.get_rank()}}, metrics={"loss": 0.25})
    # A self-describing load on every rank: each reads its own per-rank files.
    plain = CheckpointManager.Config.with_sync_save()
    plain.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with CheckpointManager(plain) as reader:
        got = reader.load(f"{root}/step_5")
    local = got["model"]["w"]
    local = local.to_local() if hasattr(local, "to_local") else local
    return {
        "rank": dist.get_rank(),
        "misc": got["misc"],
        "w_local_ok": bool(torch.equal(local, model["w"].to_local())),
    }


@pytest.fixture(scope="module")
def two_rank_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from simulator.launcher import launch

    base = tmp_path_factory.mktemp("cli2")
    results = launch(save_two_ranks, 2, args=(str(base),), timeout=240)
    assert [(r["misc"], r["w_local_ok"]) for r in results] == [({"rank": 0}, True), ({"rank": 1}, True)]
    return base


@pytest.mark.multirank
def test_inspect_and_verify_a_two_rank_checkpoint_as_subprocesses(two_rank_root: Path) -> None:
    ckpt = two_rank_root / "step_5"
    proc = _cli("inspect", "--json", str(ckpt))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["world_size"] == 2 and doc["metrics"] == {"loss": 0.25}
    assert [f["path"] for f in doc["items"]["misc"]["files"]] == ["misc_0.json", "misc_1.json"]
    sharding = {r["tensor"]: r for r in doc["items"]["model"]["sharding"]}
    assert sharding["w"]["global_shape"] == [5, 6] and sharding["w"]["placements"] == ["Shard(0)"]
    assert sharding["v"]["placements"] == ["Shard(1)"] and sharding["r"]["placements"] == ["Replicate"]
    assert sharding["w"]["mesh_shape"] == [2]
    proc = _cli("verify", str(ckpt))
    assert proc.returncode == 0 and "OK: 5/5" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.multirank
def test_export_a_two_rank_item_as_a_subprocess(two_rank_root: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    proc = _cli("export", str(two_rank_root / "step_5"), "--item", "model", "--to", "hf", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["files"] == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    got = load_file(str(out / "model-00001-of-00001.safetensors"))
    full = torch.arange(30.0).reshape(5, 6)
    assert torch.equal(got["w"], full) and torch.equal(got["v"], full.T) and torch.equal(got["r"], torch.ones(3))


@pytest.mark.multirank
def test_diff_consolidates_sharded_items(
    two_rank_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(two_rank_root / "step_5", copy)
    code, doc = _json(capsys, ["diff", str(two_rank_root / "step_5"), str(copy)])
    assert code == 0 and doc["identical"], doc


class _Tty:
    """A stdout that says it is a terminal."""

    def __init__(self) -> None:
        import io

        self.buffer = io.StringIO()

    def write(self, s: str) -> int:
        return self.buffer.write(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_tables_use_rich_on_a_terminal_and_plain_text_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_checkpointing.cli import Ui

    pytest.importorskip("rich")
    tty = _Tty()
    ui = Ui(json_mode=False, plain=False, out=tty)  # type: ignore[arg-type]
    ui.table("T", ["A", "B"], [["x", 1]])
    assert "x" in tty.buffer.getvalue() and "│" in tty.buffer.getvalue()
    monkeypatch.setitem(sys.modules, "rich", None)  # as if the [cli] extra were not installed
    monkeypatch.setitem(sys.modules, "rich.console", None)
    tty = _Tty()
    ui = Ui(json_mode=False, plain=False, out=tty)  # type: ignore[arg-type]
    ui.table("T", ["A", "B"], [["x", 1]])
    assert tty.buffer.getvalue() == "T:\n  A  B\n  x  1\n"


def test_progress_on_a_terminal_with_and_without_rich(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    from torch_checkpointing.cli import Ui

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    try:
        import rich.progress  # noqa: F401
    except ImportError:
        pass
    else:
        with Ui(json_mode=False, plain=True).progress(100, "rich bar") as advance:
            advance(100)  # the bar draws on stderr and is cleared when done
        capsys.readouterr()
    monkeypatch.setitem(sys.modules, "rich.progress", None)
    with Ui(json_mode=False, plain=True).progress(100, "verify c") as advance:
        advance(50)
        advance(50)
    assert "verify c: 100%" in capsys.readouterr().err
    with Ui(json_mode=True, plain=True).progress(100, "quiet") as advance:
        advance(100)
    assert capsys.readouterr().err == ""
