"""The operations (ls, inspect, verify, diff, gc, prune, export, latest_checkpoint, retention) against crafted and
damaged directories, with real files, FIFOs, symlinks, processes and file-size limits.

Each test here failed before its fix: a crafted manifest broke `ls` for the whole root; `diff` and `export` read
files outside the checkpoint (a `..` path, a symlinked file or directory) and hung on a FIFO; `verify` passed a
file reached through a symlinked directory; a symlink under a root was listed, kept as "newest" and made
retention delete the real newest checkpoint; gc deleted user folders that merely had one of our names;
`latest_checkpoint` returned a half-deleted checkpoint; an export mixed into an earlier one, wrote into the
checkpoint, and exported bytes that failed their checksums.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.cli import main
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.errors import CorruptCheckpointError, UnsafeCheckpointError
from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf, import_hf
from torch_checkpointing.retention import RetentionPolicy, apply_retention, collect_garbage

SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch; a hang never ends


def _save_run(root: Path, steps: tuple[int, ...] = (1, 2, 3), state: Any = None) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in steps:
            value = state if state is not None else {"model": {"w": torch.full((4,), float(step))}}
            manager.save(str(root / f"step_{step}"), value, step=step, metrics={"loss": 1.0 / step})


def _edit_manifest(ckpt: Path, change: Any) -> None:
    doc = json.loads((ckpt / "manifest.json").read_text())
    change(doc)
    (ckpt / "manifest.json").write_text(json.dumps(doc))


def _model_record(doc: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = doc["items"]["model"]["0"]
    return record


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, Any]:
    code = main(["--json", *argv])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    _save_run(root)
    return root


# ------------------------------------------------------------------------------------------------ ls


def test_ls_survives_manifests_with_impossible_commit_times(
    run: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """JSON's 1e400 is infinity and -1e18 is before any calendar: one such manifest crashed `ls` of the root
    (OverflowError, a traceback) or failed it (exit 2), and --json would print the non-JSON `Infinity`."""
    for name, text in (("inf_time", "1e400"), ("neg_time", "-1e18")):
        crafted = run / name
        shutil.copytree(run / "step_2", crafted)
        raw = (crafted / "manifest.json").read_text()
        (crafted / "manifest.json").write_text(re.sub(r'"commit_time": [0-9.e+]+', f'"commit_time": {text}', raw))
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        code = main(["--json", "ls", str(run)])
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out, parse_constant=lambda c: pytest.fail(f"ls --json printed the non-JSON constant {c}"))
    times = {c["name"]: c["commit_time"] for c in doc["checkpoints"]}
    # An infinite time is a malformed manifest (like NaN or Infinity anywhere in it): not listed, and said so;
    # a finite one no calendar shows is listed as unknown.
    assert "inf_time" not in times and times["neg_time"] is None and times["step_3"] is not None
    assert any("inf_time" in r.getMessage() and "commit_time" in r.getMessage() for r in caplog.records)
    assert any("neg_time" in r.getMessage() and "commit_time" in r.getMessage() for r in caplog.records)
    assert main(["ls", str(run)]) == 0  # the table too
    assert latest_checkpoint(run) is not None and latest_checkpoint(run).name == "step_3"  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------ reading out


def _point_outside(run: Path, how: str) -> Path:
    """A checkpoint whose model file is the outside world's (`secret/model_0.pt`, a valid torch file)."""
    secret = run.parent / "secret"
    secret.mkdir(exist_ok=True)
    shutil.copy(run / "step_1" / "model_0.pt", secret / "model_0.pt")
    crafted = run.parent / f"crafted_{how}"
    shutil.copytree(run / "step_1", crafted)
    if how == "dotdot":
        _edit_manifest(crafted, lambda d: _model_record(d).update(path="../secret/model_0.pt"))
    elif how == "symlinked_file":
        (crafted / "model_0.pt").unlink()
        (crafted / "model_0.pt").symlink_to(secret / "model_0.pt")
    else:  # a symlinked directory on the way: the last component is a regular file
        (crafted / "sub").symlink_to(secret)
        _edit_manifest(crafted, lambda d: _model_record(d).update(path="sub/model_0.pt"))
    return crafted


@pytest.mark.parametrize("how", ["dotdot", "symlinked_file", "symlinked_dir"])
def test_diff_and_export_never_read_outside_the_checkpoint(
    run: Path, how: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crafted = _point_outside(run, how)
    code, doc = _json(capsys, ["diff", str(crafted), str(run / "step_2")])
    assert code == 2 and doc["kind"] == "UnsafeCheckpointError", doc  # it was "differs: max abs diff 1"
    assert "model_0.pt" in doc["error"]
    out = tmp_path / "hf_out"
    with pytest.raises(UnsafeCheckpointError, match="model_0.pt"):
        export_hf(crafted, "model", out)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".export-tmp-" in p.name]


def test_verify_refuses_a_file_reached_through_a_symlinked_directory(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The outside file matches the record byte for byte, so only containment can refuse it: verify said OK."""
    crafted = _point_outside(run, "symlinked_dir")
    code, doc = _json(capsys, ["verify", str(crafted)])
    assert code == 1 and doc["ok"] is False
    (bad,) = doc["files"]
    assert bad["path"] == "sub/model_0.pt" and "symbolic link" in bad["problem"]


FIFO_SCRIPT = """
import json, sys
from torch_checkpointing.cli import main
from torch_checkpointing.hf import import_hf
ckpt, stray, out, hf_dir = sys.argv[1:5]
codes = {
    "verify": main(["verify", ckpt]),
    "diff": main(["diff", ckpt, ckpt]),
    "export": main(["export", ckpt, "--item", "model", "--to", "hf", out]),
    "inspect_stray_metadata": main(["inspect", stray]),
}
try:
    import_hf(hf_dir)
    codes["import"] = "read"
except Exception as exc:
    codes["import"] = type(exc).__name__
print("CODES " + json.dumps(codes), flush=True)
"""


def test_fifos_never_hang_verify_diff_export_inspect_or_import(run: Path, tmp_path: Path) -> None:
    """A FIFO where a file should be blocked the reader forever; each command must answer, naming the file."""
    fifo_ckpt = tmp_path / "fifo_ckpt"
    shutil.copytree(run / "step_1", fifo_ckpt)
    (fifo_ckpt / "model_0.pt").unlink()
    os.mkfifo(fifo_ckpt / "model_0.pt")

    def empty_record(doc: dict[str, Any]) -> None:
        record = _model_record(doc)
        record.update(size=0, crc32=0)
        record.pop("blocks", None)

    _edit_manifest(fifo_ckpt, empty_record)
    stray = tmp_path / "stray_metadata"  # a plain checkpoint whose manifest names no metadata file
    shutil.copytree(run / "step_1", stray)
    os.mkfifo(stray / "metadata.json")
    hf_dir = tmp_path / "hf_fifo"
    hf_dir.mkdir()
    os.mkfifo(hf_dir / "model.safetensors")
    args = [str(fifo_ckpt), str(stray), str(tmp_path / "out"), str(hf_dir)]
    proc = subprocess.run(
        [sys.executable, "-c", FIFO_SCRIPT, *args], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
    )
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("CODES ")]
    codes = json.loads(line[len("CODES ") :])
    assert codes == {
        "verify": 1,
        "diff": 2,
        "export": 2,
        "inspect_stray_metadata": 0,
        "import": "UnsafeCheckpointError",
    }, proc.stderr
    assert "not a regular file" in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ discovery


def test_symlinks_under_a_root_are_never_listed_pruned_or_collected(run: Path, tmp_path: Path) -> None:
    """A link to a checkpoint elsewhere (with a higher step) was listed as the newest, so `prune --keep-last 1`
    kept the link and deleted the real newest checkpoint; a user's `latest -> step_3` link was renamed away."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run / "step_3", elsewhere / "step_9")
    _edit_manifest(elsewhere / "step_9", lambda d: d.update(step=9))
    (run / "step_9").symlink_to(elsewhere / "step_9")
    (run / "latest").symlink_to("step_3")
    userdata = tmp_path / "userdata"
    (userdata / "keep").mkdir(parents=True)
    (userdata / "keep" / "f").write_text("mine")
    (run / ".x.tmp-0badc0de-1").symlink_to(userdata)
    (run / ".x.trash-999999-abcdef01").symlink_to(userdata)

    assert [c.name for c in list_checkpoints(run)] == ["step_1", "step_2", "step_3"]
    assert latest_checkpoint(run).name == "step_3"  # type: ignore[union-attr]
    assert list_leftovers(run) == []
    assert main(["prune", str(run), "--keep-last", "1"]) == 0
    assert main(["gc", str(run), "--older-than", "0"]) == 0
    left = [".x.tmp-0badc0de-1", ".x.trash-999999-abcdef01", "latest", "step_3", "step_9"]
    assert sorted(p.name for p in run.iterdir()) == left
    assert sorted(p.name for p in (elsewhere / "step_9").iterdir()) == ["manifest.json", "model_0.pt"]
    assert (userdata / "keep" / "f").read_text() == "mine"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid


def test_gc_keeps_user_folders_that_merely_have_our_names(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pid = _dead_pid()
    mine = {
        f".notes.trash-{pid}-abcdef01": "trash",
        f".old_step_1_{pid}": "replaced",  # step_1 exists, so a real one would be garbage
        ".data.tmp-0123abcd-1": "temporary",  # no owner lock on this host: judged by age
    }
    for name in mine:
        (run / name).mkdir()
        (run / name / "notes.txt").write_text("user data")
        old = time.time() - 7 * 24 * 3600
        os.utime(run / name, (old, old))
    ours = run / f".step_9.trash-{pid}-0fedcba9"  # a killed deletion of ours: its manifest is still there
    shutil.copytree(run / "step_2", ours)
    (run / f".step_8.trash-{pid}-0fedcba8").mkdir()  # emptied all the way

    code, doc = _json(capsys, ["gc", str(run), "--older-than", "0"])
    assert code == 0
    assert sorted(Path(r["path"]).name for r in doc["removed"]) == sorted([ours.name, f".step_8.trash-{pid}-0fedcba8"])
    kept = {Path(r["path"]).name: r["reason"] for r in doc["kept"]}
    assert set(kept) == set(mine) and all("delete it by hand" in why for why in kept.values()), kept
    for name in mine:
        assert (run / name / "notes.txt").read_text() == "user data"


KILLED_DELETION_CHILD = """
import os, sys, time
from torch_checkpointing.retention import RetentionPolicy, apply_retention

real_unlink, done, hang_after = os.unlink, [], int(sys.argv[2])
def unlink_then_hang(path, *args, **kwargs):
    real_unlink(path, *args, **kwargs)
    done.append(path)
    if len(done) == hang_after:
        print("MID-DELETION", flush=True)
        time.sleep(600)
os.unlink = unlink_then_hang
apply_retention(sys.argv[1], RetentionPolicy(keep_last=1))
"""


def test_a_deletion_killed_mid_way_leaves_a_trash_gc_still_recognises(tmp_path: Path) -> None:
    """The manifest is removed last, so a SIGKILLed deletion leaves a trash directory gc recognises as ours.

    The child is killed when one file of the checkpoint is left: that file must be its manifest."""
    root = tmp_path / "run"
    state = {"model": {f"t{i}": torch.full((8,), float(i)) for i in range(4)}, "extra": {"n": 1}}
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(root / "step_1"), state, step=1)
        manager.save(str(root / "step_2"), state, step=2)
    files = [p for p in (root / "step_1").rglob("*") if not p.is_dir()]
    argv = [sys.executable, "-c", KILLED_DELETION_CHILD, str(root), str(len(files) - 1)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "MID-DELETION"
    finally:
        proc.kill()
        proc.wait(60)
    (trash,) = list_leftovers(root)
    assert trash.kind == "trash"
    assert [p.name for p in Path(trash.path).rglob("*") if not p.is_dir()] == ["manifest.json"]
    assert getattr(trash, "recognised", True)
    assert [Path(lo.path) for lo in collect_garbage(root).removed] == [Path(trash.path)]
    assert [c.name for c in list_checkpoints(root)] == ["step_2"]


@pytest.mark.parametrize("damage", ["file_removed", "file_is_a_symlink", "file_truncated"])
def test_latest_skips_a_damaged_newest_checkpoint_and_retention_keeps_the_resume_point(
    run: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A newest checkpoint half deleted by hand (or with a file swapped for a link) was returned as the resume
    point, and `keep_last=1` then deleted the intact one a resume needs."""
    victim = run / "step_3" / "model_0.pt"
    if damage == "file_removed":
        victim.unlink()
    elif damage == "file_is_a_symlink":
        shutil.copy(victim, run.parent / "copy.pt")
        victim.unlink()
        victim.symlink_to(run.parent / "copy.pt")
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        latest = latest_checkpoint(run)
    assert latest is not None and latest.name == "step_2"
    assert any("step_3" in r.getMessage() and "model_0.pt" in r.getMessage() for r in caplog.records)
    deleted = apply_retention(run, RetentionPolicy(keep_last=1))
    assert [c.name for c in deleted] == ["step_1"]
    assert sorted(p.name for p in run.iterdir()) == ["step_2", "step_3"]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        assert torch.equal(manager.load(latest.path)["model"]["w"], torch.full((4,), 2.0))


def test_prune_of_a_missing_root_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, doc = _json(capsys, ["prune", str(tmp_path / "absent"), "--keep-last", "1"])
    assert code == 2 and "no such directory" in doc["error"]


# ------------------------------------------------------------------------------------------------ export


def _export_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "a": torch.randn(4096, generator=g),  # 16 KiB
            "b": torch.randn(4096, generator=g),
            "c": torch.randn(65536, generator=g),  # 256 KiB
        }
    }


def test_export_refuses_an_earlier_export_and_overwrite_replaces_only_its_files(tmp_path: Path) -> None:
    """Exporting into a directory that held a 3-shard export left its stale shards beside a 1-shard index."""
    state = _export_state()
    _save_run(tmp_path / "run", (1,), state)
    out = tmp_path / "hf_model"
    export_hf(tmp_path / "run" / "step_1", "model", out, max_shard_size="20KB")
    (out / "config.json").write_text("{}")  # what a user adds beside an export
    before = sorted(p.name for p in out.iterdir())
    assert len([n for n in before if n.endswith(".safetensors")]) == 3
    with pytest.raises(FileExistsError, match="overwrite"):
        export_hf(tmp_path / "run" / "step_1", "model", out)
    assert sorted(p.name for p in out.iterdir()) == before
    export_hf(tmp_path / "run" / "step_1", "model", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors", INDEX_FILE_NAME]
    loaded = import_hf(out)
    assert all(torch.equal(loaded[k], v) for k, v in state["model"].items())
    assert (out / "config.json").read_text() == "{}"


def test_export_never_writes_into_the_checkpoint(tmp_path: Path) -> None:
    _save_run(tmp_path / "run", (1,))
    ckpt = tmp_path / "run" / "step_1"
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt / "hf"):
        with pytest.raises(ValueError, match="inside the checkpoint"):
            export_hf(ckpt, "model", out)
    assert sorted(p.name for p in ckpt.iterdir()) == before


def test_export_of_damaged_bytes_fails_and_leaves_no_output(tmp_path: Path) -> None:
    """The export read tensors without their checksums: a flipped byte went out as a valid-looking model."""
    state = _export_state()
    _save_run(tmp_path / "run", (1,), state)
    ckpt = tmp_path / "run" / "step_1"
    data = bytearray((ckpt / "model_0.pt").read_bytes())
    at = data.find(state["model"]["c"].numpy().tobytes()[:64])
    assert at > 0, "the payload of tensor c was not found in the file"
    data[at + 1000] ^= 0xFF
    (ckpt / "model_0.pt").write_bytes(bytes(data))
    out = tmp_path / "hf_model"
    with pytest.raises(CorruptCheckpointError, match="model_0.pt"):
        export_hf(ckpt, "model", out, max_shard_size="20KB")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


FSIZE_CHILD = """
import resource, signal, sys
from torch_checkpointing.hf import export_hf
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    export_hf(sys.argv[1], "model", sys.argv[2], max_shard_size="20KB", overwrite=True)
except OSError as exc:
    print("FAILED", exc, flush=True)
"""


def test_an_export_that_runs_out_of_file_size_leaves_the_earlier_export_intact(tmp_path: Path) -> None:
    """The two small shards fit under RLIMIT_FSIZE, the 256 KiB one does not: the earlier export in the
    directory must still be whole and consistent (it had been overwritten shard by shard beside its old index)."""
    state = _export_state()
    _save_run(tmp_path / "run", (1,), state)
    small = {"model": {"a": torch.zeros(8), "b": torch.ones(8), "c": torch.full((8,), 2.0)}}
    _save_run(tmp_path / "small", (1,), small)
    out = tmp_path / "hf_model"
    export_hf(tmp_path / "small" / "step_1", "model", out, max_shard_size="20KB")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = subprocess.run(
        [sys.executable, "-c", FSIZE_CHILD, str(tmp_path / "run" / "step_1"), str(out)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.stdout.startswith("FAILED") and "File too large" in proc.stdout, proc.stdout + proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if ".export-tmp-" in p.name]
    loaded = import_hf(out)
    assert all(torch.equal(loaded[k], v) for k, v in small["model"].items())


FSIZE_ERRNO_CHILD = """
import resource, signal, sys
from torch_checkpointing.hf import export_hf
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    export_hf(sys.argv[1], "model", sys.argv[2], max_shard_size="20KB")
except OSError as exc:
    print("FAILED", type(exc).__name__, exc.errno, exc, flush=True)
"""


def test_an_export_shard_past_the_file_size_limit_is_an_os_error_with_its_errno_and_the_fix(tmp_path: Path) -> None:
    """A shard that safetensors cannot write (its error carries the OS error only in its text) must be an OSError
    with that errno, saying nothing was exported and what to do, as the index's write error does. Defect: a
    bare OSError(message) whose errno was None and which named no fix."""
    _save_run(tmp_path / "run", (1,), _export_state())
    proc = subprocess.run(
        [sys.executable, "-c", FSIZE_ERRNO_CHILD, str(tmp_path / "run" / "step_1"), str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.stdout.startswith(f"FAILED OSError {errno.EFBIG} "), proc.stdout + proc.stderr
    assert "nothing was exported" in proc.stdout and "file-size limit" in proc.stdout, proc.stdout
    assert not (tmp_path / "hf").exists()


KILLED_EXPORT_CHILD = """
import os, signal, sys
import safetensors.torch
from torch_checkpointing.hf import export_hf
real_save_file = safetensors.torch.save_file
def save_then_die(*args, **kwargs):
    real_save_file(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)  # one shard written, the export not finished
safetensors.torch.save_file = save_then_die
export_hf(sys.argv[1], "model", sys.argv[2], max_shard_size="20KB")
"""


@pytest.mark.parametrize("out_name", ["hf", "h" * 255])  # a long name's hidden sibling must still fit NAME_MAX
def test_a_killed_exports_hidden_folder_is_removed_by_the_next_export(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, out_name: str
) -> None:
    """A SIGKILLed export left `.hf.export-tmp-<pid>-<nonce>/` beside its output, which nothing removed or named.

    The next export beside it removes it once its process is gone (with a WARNING naming it); a folder under
    such a name that holds anything an export never writes is left, and named."""
    _save_run(tmp_path / "run", (1,), _export_state())
    out = tmp_path / out_name
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT_CHILD, str(tmp_path / "run" / "step_1"), str(out)],
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (left,) = [p for p in tmp_path.iterdir() if ".export-tmp-" in p.name]
    assert [p.name for p in left.iterdir()] == ["model-00001-of-00003.safetensors"] and not out.exists()
    foreign = tmp_path / f".other.export-tmp-{_dead_pid()}-0abc"  # our name, somebody's file
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
        export_hf(tmp_path / "run" / "step_1", "model", out, max_shard_size="20KB")
    assert not left.exists() and (foreign / "notes.txt").read_text() == "mine"
    logged = [r.getMessage() for r in caplog.records]
    assert any(str(left) in m and "died" in m for m in logged) and any(str(foreign) in m for m in logged), logged
    assert sorted(p.name for p in out.iterdir())[-1] == INDEX_FILE_NAME


# ------------------------------------------------------------------------------------------------ import


def test_import_refuses_an_index_that_names_files_outside_its_directory(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "secret.safetensors"))
    hf_dir = tmp_path / "downloaded"
    hf_dir.mkdir()
    for target in ("../secret.safetensors", str(tmp_path / "secret.safetensors")):
        index = {"metadata": {}, "weight_map": {"w": target}}
        (hf_dir / INDEX_FILE_NAME).write_text(json.dumps(index))
        with pytest.raises(UnsafeCheckpointError, match="weight_map"):
            import_hf(hf_dir)


def test_import_follows_a_cache_snapshot_of_symlinks_to_regular_files(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot is made of symlinks to blobs: that must keep working."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    save_file({"w": torch.arange(3.0)}, str(blobs / "abc123"))
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").symlink_to(blobs / "abc123")
    assert torch.equal(import_hf(snapshot)["w"], torch.arange(3.0))
    assert torch.equal(load_file(str(snapshot / "model.safetensors"))["w"], torch.arange(3.0))


def test_crafted_manifests_with_huge_steps_and_deep_nesting_do_not_break_listing(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A step of 10**300 is legal JSON and sorts last; deep nesting or a negative step is refused by the parser
    (the checkpoint is skipped), never a crash of `ls` for the root."""
    for name, change in (
        ("huge_step", lambda d: d.update(step=10**300)),
        ("negative_step", lambda d: d.update(step=-5)),
    ):
        shutil.copytree(run / "step_1", run / name)
        _edit_manifest(run / name, change)
    shutil.copytree(run / "step_1", run / "deep")
    raw = (run / "deep" / "manifest.json").read_text()
    (run / "deep" / "manifest.json").write_text(raw.replace('"step": 1', '"step": 1, "x": ' + "[" * 5000 + "]" * 5000))
    code, doc = _json(capsys, ["ls", str(run)])
    assert code == 0
    assert [c["name"] for c in doc["checkpoints"]] == ["step_1", "step_2", "step_3", "huge_step"]


@pytest.mark.parametrize("age", ["nan", "-1"])
def test_gc_refuses_an_age_threshold_that_would_collect_every_unowned_temporary(tmp_path: Path, age: str) -> None:
    """NaN compares false with every age, so `--older-than nan` removed a temporary written a second ago whose
    owner cannot be checked on this host (a save running on another node)."""
    temporary = tmp_path / ".step_1.tmp-0badc0de-1"
    temporary.mkdir()
    (temporary / ".incomplete").write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        main(["gc", str(tmp_path), "--older-than", age])
    assert exc.value.code == 2 and temporary.is_dir()
    with pytest.raises(ValueError, match="unowned_after_s"):
        collect_garbage(tmp_path, unowned_after_s=float(age))
    with pytest.raises(ValueError, match="unowned_after_s"):
        RetentionPolicy(keep_last=1, unowned_after_s=float(age))
    assert temporary.is_dir()


def test_a_file_passed_where_a_directory_belongs_is_named_as_a_file(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Passing a checkpoint's file said "no such directory", which sends the user looking for a missing path."""
    f = str(run / "step_1" / "model_0.pt")
    for argv in (
        ["inspect", f],
        ["diff", f, f],
        ["ls", f],
        ["gc", f],
        ["prune", f, "--keep-last", "1"],
        ["export", f, "--item", "model", "--to", "hf", str(tmp_path / "out")],
    ):
        code, doc = _json(capsys, argv)
        assert code == 2 and "is a file, not a directory: pass" in doc["error"], (argv, doc)
    code, doc = _json(capsys, ["verify", f])
    assert code == 1 and "is a file, not a directory" in doc["error"]
    assert not (tmp_path / "out").exists()


def test_a_damaged_manifest_is_skipped_with_a_warning_and_a_foreign_one_quietly(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated manifest of ours made its checkpoint vanish from `ls` and "latest" with a DEBUG line only."""
    raw = (run / "step_3" / "manifest.json").read_bytes()
    (run / "step_3" / "manifest.json").write_bytes(raw[: len(raw) // 2])
    (run / "other_tool").mkdir()
    (run / "other_tool" / "manifest.json").write_text(json.dumps({"kind": "webpack", "files": []}))
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        latest = latest_checkpoint(run)
    assert latest is not None and latest.name == "step_2"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "step_3" in warned[0] and "not valid JSON" in warned[0], warned


@pytest.mark.parametrize("at_the_name", ["empty_folder", "symlink_to_the_copy", "incomplete"])
def test_a_replaced_copy_is_kept_unless_a_committed_checkpoint_took_its_name(run: Path, at_the_name: str) -> None:
    """`.old_{id}_{pid}` was removed whenever anything existed at the id: an empty folder, a link (to the copy
    itself), or a save that never finished; the copy set aside was then the only one, and it was deleted."""
    aside = run / f".old_step_3_{_dead_pid()}"
    os.rename(run / "step_3", aside)
    name = run / "step_3"
    if at_the_name == "empty_folder":
        name.mkdir()
    elif at_the_name == "symlink_to_the_copy":
        name.symlink_to(aside.name)
    else:
        shutil.copytree(aside, name)
        (name / ".incomplete").write_bytes(b"")
    report = collect_garbage(run, unowned_after_s=0)
    assert report.removed == [] and aside.is_dir()
    reasons = [why for lo, why in report.kept if lo.path == str(aside)]
    assert reasons and "only copy" in reasons[0], report.kept


LOCK_FIFO_CHILD = """
import sys
from torch_checkpointing.discovery import OwnerLock, list_leftovers
from torch_checkpointing.retention import collect_garbage
(leftover,) = list_leftovers(sys.argv[1])
print("OWNER", leftover.owner_alive, flush=True)
print("REMOVED", len(collect_garbage(sys.argv[1], unowned_after_s=0).removed), flush=True)
lock = OwnerLock("feedbeef")
print("LOCK", lock._fd is not None, flush=True)
lock.release()
"""


def test_a_fifo_planted_as_an_owner_lock_hangs_neither_gc_nor_a_manager(tmp_path: Path) -> None:
    """The owner-lock directory is shared by every user of the host; a FIFO under a job's uid blocked gc's
    open() (and a manager's) forever."""
    lock_dir = tmp_path / "owners"
    lock_dir.mkdir()
    os.mkfifo(lock_dir / "0badc0de.lock")
    os.mkfifo(lock_dir / "feedbeef.lock")
    root = tmp_path / "run"
    temporary = root / ".step_1.tmp-0badc0de-1"
    temporary.mkdir(parents=True)
    (temporary / ".incomplete").write_bytes(b"")
    env = {**os.environ, "TORCH_CHECKPOINTING_LOCK_DIR": str(lock_dir)}
    proc = subprocess.run(
        [sys.executable, "-c", LOCK_FIFO_CHILD, str(root)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=env,
    )
    # Unknown owner, judged by age (0 here): collected; the manager runs without its lock (judged by age too).
    assert proc.stdout.split() == ["OWNER", "None", "REMOVED", "1", "LOCK", "False"], proc.stdout + proc.stderr
    assert "not a regular file" in proc.stderr


def test_export_into_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`export CKPT --to hf .` must keep working with the hidden sibling (Path('.') has no name)."""
    _save_run(tmp_path / "run", (1,))
    out = tmp_path / "hf_here"
    out.mkdir()
    monkeypatch.chdir(out)
    assert main(["export", str(tmp_path / "run" / "step_1"), "--item", "model", "--to", "hf", "."]) == 0
    assert torch.equal(import_hf(out)["w"], torch.full((4,), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf_here", "run"]
