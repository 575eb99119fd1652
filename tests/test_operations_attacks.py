"""The operations layer (listing, retention, the CLI, HF export) attacked with real processes, pipes, terminals,
concurrent deletions and file-size limits.

Each test failed before its fix: `| head -1` printed a BrokenPipeError traceback (and an `--json` error
document into the closed pipe); two retention runs on one root crashed one of them with a bare
FileNotFoundError and warned "could not delete" for checkpoints the other had deleted; a listing that met a
checkpoint deleted meanwhile warned it was damaged; a checkpoint named with `[bold]` or an escape sequence was
rendered as markup or sent raw to the terminal; an export whose index did not fit the disk said only
"[Errno 27] File too large".
"""

from __future__ import annotations

import json
import logging
import os
import pty
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.probes import stop
from torch_checkpointing import CheckpointManager, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import RetentionPolicy, apply_retention, collect_garbage, delete_checkpoint
from torch_checkpointing.storage.filesystem import LocalFileSystemStorage, LocalFileSystemStorageConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch; a hang never ends


def _save_one(root: Path, state: Any = None) -> Path:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(root / "step_1"), state or {"model": {"w": torch.ones(4)}}, step=1, metrics={"loss": 1.0})
    return root / "step_1"


def _copy_as(src: Path, dst: Path, step: int) -> None:
    """A copy of a committed checkpoint under another name and step (what a long run leaves, made fast)."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "manifest.json").read_text())
    doc["step"] = step
    (dst / "manifest.json").write_text(json.dumps(doc))


def _wide_root(tmp_path: Path, count: int) -> Path:
    root = tmp_path / "run"
    first = _save_one(root)
    for step in range(2, count + 1):
        _copy_as(first, root / f"step_{step}", step)
    return root


def _cli_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch_checkpointing", *args]


# ------------------------------------------------------------------------------------------------ closed pipes


@pytest.mark.parametrize("json_mode", [True, False])
def test_output_into_a_closed_pipe_prints_no_traceback(tmp_path: Path, json_mode: bool) -> None:
    """`torch-checkpointing ls ROOT | head -1`: the reader goes away after one line. BrokenPipeError is an
    OSError, so the generic error branch caught it first: it printed "error: [Errno 32] Broken pipe", exit 2,
    and in --json mode wrote an error document into the same closed pipe (a second traceback)."""
    root = _wide_root(tmp_path, 1200)  # far more output, plain too, than a pipe buffers (64 KiB)
    argv = ["--json", "ls", str(root)] if json_mode else ["ls", str(root)]
    proc = subprocess.Popen(_cli_cmd(*argv), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # what `head -1` does once it has its line
    err = proc.stderr.read().decode()
    code = proc.wait(SUBPROCESS_TIMEOUT_S)
    assert first.strip(), err
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err
    assert code == 0, err


def test_a_broken_pipe_that_is_not_stdout_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The closed-pipe exit must not swallow a store's own EPIPE (a connection the peer closed mid-transfer): that
    is a failed command, exit 2 with its message, while stdout is still open."""
    from torch_checkpointing import cli

    def cmd_gc_on_a_closed_connection(args: Any, ui: Any, storage: Any) -> int:
        reader, writer = os.pipe()
        os.close(reader)
        try:
            os.write(writer, b"x")  # EPIPE, as a socket whose peer hung up gives it
        finally:
            os.close(writer)
        return 0

    monkeypatch.setattr(cli, "cmd_gc", cmd_gc_on_a_closed_connection)
    assert cli.main(["gc", str(tmp_path)]) == 2
    assert "error: [Errno 32] Broken pipe" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ concurrent retention

PRUNE_CHILD = """
import json, logging, sys
from torch_checkpointing.retention import RetentionPolicy, apply_retention
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])
logging.getLogger("torch_checkpointing").addHandler(Keep())
logging.getLogger("torch_checkpointing").setLevel(logging.INFO)
print("ready", flush=True)
sys.stdin.readline()  # start together
deleted = apply_retention(sys.argv[1], RetentionPolicy(keep_last=1))
print(json.dumps({"deleted": [c.name for c in deleted], "records": records}), flush=True)
"""


def test_two_retention_runs_on_one_root_both_finish_and_delete_each_checkpoint_once(tmp_path: Path) -> None:
    """Two processes prune the same root at once (a training run's retention and an operator's `prune`).

    Before: the loser of a race on one checkpoint crashed the whole pass with a bare FileNotFoundError from
    inside the foreign-file check (the rest of its policy and its gc never ran), or logged "could not delete
    ... it is left as it was" at WARNING for a checkpoint the other process had just deleted."""
    root = _wide_root(tmp_path, 300)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRUNE_CHILD, str(root)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for p in procs:  # both have imported torch and wait on stdin
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], SUBPROCESS_TIMEOUT_S)
        assert ready and p.stdout.readline() == "ready\n", p.stderr.read() if p.stderr and p.poll() is not None else ""
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = [p.communicate(timeout=SUBPROCESS_TIMEOUT_S) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0 and out.strip(), err[-3000:]
    docs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    warnings = [m for d in docs for level, m in d["records"] if level != "INFO" and level != "DEBUG"]
    assert warnings == [], warnings[:5]
    deleted = [name for d in docs for name in d["deleted"]]
    assert sorted(deleted) == sorted(f"step_{s}" for s in range(1, 300)), "each deleted once, by one of them"
    assert [c.name for c in list_checkpoints(root)] == ["step_300"]
    assert sorted(os.listdir(root)) == ["step_300"]


class _VanishingStorage(LocalFileSystemStorage):
    """The local store, except that another process (here: this one, with a real rmtree) removes `victim` just
    after the `nth` time the code under test asks `on` about `trigger` (a path inside it, or itself) and has
    been answered: the window between a check and the use of its answer, held open."""

    def __init__(self, victim: Path, on: str, trigger: str = "", nth: int = 1) -> None:
        super().__init__(LocalFileSystemStorageConfig(use_direct_io=False))
        self.victim, self.on, self.trigger, self.left = victim, on, victim / trigger, nth

    @property
    def fired(self) -> bool:
        return self.left <= 0

    def _strike(self, path: Path, op: str) -> None:
        if self.left > 0 and op == self.on and Path(path) == self.trigger:
            self.left -= 1
            if self.left == 0:
                shutil.rmtree(self.victim)

    def isdir(self, path: Path) -> bool:
        answer = super().isdir(path)
        self._strike(path, "isdir")
        return answer

    def exists(self, path: Path) -> bool:
        answer = super().exists(path)
        self._strike(path, "exists")
        return answer

    def ls(self, path: Path) -> list[str]:
        answer = super().ls(path)
        self._strike(path, "ls")
        return answer

    def rename(self, src_path: Path, dst_path: Path, *args: Any, **kwargs: Any) -> None:
        self._strike(src_path, "rename")  # before: the other process got there first
        super().rename(src_path, dst_path, *args, **kwargs)

    def rmdir(self, path: Path) -> None:
        self._strike(path, "rmdir")  # before: the other process got there first
        super().rmdir(path)


@pytest.mark.parametrize("window", ["ls", "rename"])
def test_deleting_a_checkpoint_another_process_just_deleted_is_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, window: str
) -> None:
    """The checkpoint is still there when it is checked against its listing, gone once its files were listed
    (its manifest then unreadable: every file looked foreign, "holds files that are not part of it") or just
    before its rename ("could not delete ... left as it was"): the deletion's goal is met by the other
    process; it must return False with an INFO saying so, never warn or raise."""
    root = _wide_root(tmp_path, 2)
    (info,) = [c for c in list_checkpoints(root) if c.name == "step_1"]
    storage = _VanishingStorage(root / "step_1", on=window)
    with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
        assert delete_checkpoint(info.path, storage, expected=info) is False
    assert storage.fired
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("another process" in r.getMessage() and "step_1" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(root)) == ["step_2"]


def test_a_checkpoint_deleted_while_a_root_is_listed_is_not_called_damaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`ls`/`latest_checkpoint` met a checkpoint that retention removed between seeing its manifest and reading
    it, and warned "Skipping ..., a damaged checkpoint: Cannot open ... No such file": an alarm about a
    checkpoint that is simply gone. Retention on the same root sees the same."""
    root = _wide_root(tmp_path, 3)
    # read_manifest confirms the manifest is there (the listing's second look), then opens it: removed between.
    storage = _VanishingStorage(root / "step_2", on="exists", trigger="manifest.json", nth=2)
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        found = list_checkpoints(root, storage)
    assert storage.fired
    assert [c.name for c in found] == ["step_1", "step_3"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    storage = _VanishingStorage(root / "step_1", on="exists", trigger="manifest.json", nth=2)
    with caplog.at_level(logging.DEBUG, logger="torch_checkpointing"):
        caplog.clear()
        assert apply_retention(root, RetentionPolicy(keep_last=1), storage) == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert sorted(os.listdir(root)) == ["step_3"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(60)
    return proc.pid


@pytest.mark.parametrize("kind", ["temporary", "trash", "replaced"])
def test_gc_of_a_leftover_another_gc_removed_first_is_no_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """Two `gc` runs on one root: the one that lost the race on a dead save's temporary ("could not move ...
    aside"), a dead deletion's trash ("Could not remove") or a killed replace's copy ("could not move ... back,
    rename it by hand") warned and reported it FAILED (exit 1), though the other one had done the job."""
    root = _wide_root(tmp_path, 1)
    pid = _dead_pid()
    name = {
        "temporary": ".step_2.tmp-0badc0de-7",  # no owner lock on this host: collected with --older-than 0
        "trash": f".step_2.trash-{pid}-0abc1234",
        "replaced": f".old_step_2_{pid}",  # nothing at step_2: gc moves it back
    }[kind]
    shutil.copytree(root / "step_1", root / name)
    window = "rmdir" if kind == "trash" else "rename"
    storage = _VanishingStorage(root / name, on=window)
    with caplog.at_level(logging.INFO, logger="torch_checkpointing"):
        report = collect_garbage(root, storage, unowned_after_s=0.0)
    assert storage.fired
    assert report.failed == [] and report.removed == [], report
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("another process" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(root)) == ["step_1"]


OVERWRITER_CHILD = """
import sys, time, torch
from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
if __name__ == "__main__":
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        n = 0
        while sys.stdin.readline().strip() == "again":
            manager.save(sys.argv[1], {"model": {"w": torch.full((1 << 16,), float(n))}}, step=2)
            n += 1
            print("saved", n, flush=True)
"""


def test_latest_during_an_overwrite_of_the_newest_id_returns_it_and_warns_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process saves the newest id again and again (a job re-saving `latest`), while this one asks
    `latest_checkpoint`. The check that the newest is intact opened the old copy just as the replace removed
    it: `latest_checkpoint` went back a step (to a checkpoint older than any the id ever held) and warned that
    the newest one was damaged (about 1 in 200 calls here before the fix)."""
    root = _wide_root(tmp_path, 2)  # step_1, and step_2 that the child re-saves
    child = subprocess.Popen(
        [sys.executable, "-c", OVERWRITER_CHILD, str(root / "step_2")],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    assert child.stdin is not None and child.stdout is not None
    answers: dict[str | None, int] = {}
    saves = 0
    try:
        with caplog.at_level(logging.WARNING, logger="torch_checkpointing"):
            child.stdin.write("again\n" * 400)  # queued: the child saves back to back, 400 times
            child.stdin.flush()
            deadline = time.monotonic() + 120
            while saves < 400 and time.monotonic() < deadline:
                info = latest_checkpoint(root)
                name = None if info is None else info.name
                answers[name] = answers.get(name, 0) + 1
                while select.select([child.stdout], [], [], 0)[0]:
                    if not child.stdout.readline():
                        saves = 400  # the child ended
                        break
                    saves += 1
    finally:
        child.stdin.close()  # the child stops at the end of its queue
        child.stdout.read()
        assert child.stderr is not None
        err = child.stderr.read()
        child.wait(SUBPROCESS_TIMEOUT_S)
    assert child.returncode == 0, err[-3000:]
    assert sum(answers.values()) > 200, answers  # the two really overlapped
    assert answers == {"step_2": sum(answers.values())}, answers
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("kind", ["temporary", "trash"])
def test_a_leftover_removed_while_gc_classifies_it_is_not_called_a_users_folder(tmp_path: Path, kind: str) -> None:
    """`ls`/`gc --dry-run` beside a gc in another process: a leftover removed between being listed and being
    looked into held nothing of ours by then, so it was shown as kept, "named like a ... directory of ours but
    holds no manifest.json ... delete it by hand if it is garbage": a folder that no longer exists."""
    root = _wide_root(tmp_path, 1)
    name = {"temporary": ".step_2.tmp-0badc0de-7", "trash": f".step_2.trash-{_dead_pid()}-0abc1234"}[kind]
    shutil.copytree(root / "step_1", root / name)
    storage = _VanishingStorage(root / name, on="isdir")
    report = collect_garbage(root, storage, dry_run=True, unowned_after_s=0.0)
    assert storage.fired
    assert (report.removed, report.kept, report.failed) == ([], [], []), report


def test_a_directory_created_while_it_is_checked_is_never_called_a_file(tmp_path: Path) -> None:
    """`require_directory` asked "a directory?" and then "anything there?": a checkpoint that a save committed
    between the two answers was reported as "is a file, not a directory". One look answers both. A link loop
    at the name was "no such directory"; it is named for what it is."""
    from torch_checkpointing.discovery import require_directory

    root = _wide_root(tmp_path, 1)
    appearing = root / "step_2"

    class Appearing(_VanishingStorage):
        def isdir(self, path: Path) -> bool:
            answer = super().isdir(path)
            if Path(path) == appearing and not appearing.exists():
                shutil.copytree(root / "step_1", appearing)  # a save committed just after the look
            return answer

    with pytest.raises(FileNotFoundError, match="no such directory"):
        require_directory(Appearing(root / "step_1", on="none"), appearing, "a checkpoint directory")
    (root / "loop").symlink_to(root / "loop")
    with pytest.raises(NotADirectoryError, match="loop.*symbolic links"):
        require_directory(Appearing(root / "step_1", on="none"), root / "loop", "a checkpoint directory")


# ------------------------------------------------------------------------------------------------ terminals


def _on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run the CLI with its stdout on a real pseudo-terminal (so `rich` draws, when installed)."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen(_cli_cmd(*args), cwd=REPO, stdout=slave, stderr=subprocess.PIPE, env=env)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        if not ready:
            if proc.poll() is not None:
                break
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.stderr is not None
    err = proc.stderr.read().decode()
    return proc.wait(SUBPROCESS_TIMEOUT_S), b"".join(chunks).decode(errors="replace"), err


@pytest.mark.parametrize("terminal", [True, False])
def test_checkpoint_names_are_shown_as_names_never_as_markup_or_terminal_codes(tmp_path: Path, terminal: bool) -> None:
    """A directory name is data from whoever can write into the root. On a terminal `rich` read `[bold red]x`
    as markup (the name shown as a red `x`, `step_1[x]` as `step_1`), and an escape sequence in a name (here:
    clear the screen) reached the terminal raw, in plain output too; a newline in a name forged a table row."""
    root = tmp_path / "run"
    first = _save_one(root)
    names = ["[bold red]step_2", "step_3[x]", "step_4\x1b[2J", "step_5\n  step_99  99  forged"]
    names.append(os.fsdecode(b"step_6\xff"))  # not UTF-8: shown as the byte it is
    for step, name in enumerate(names, start=2):
        _copy_as(first, root / name, step)
    if terminal:
        pytest.importorskip("rich")
        code, out, err = _on_a_terminal("ls", str(root))
    else:
        proc = subprocess.run(
            _cli_cmd("ls", str(root)), cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S
        )
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    assert code == 0, err
    assert "\x1b[2J" not in out and "step_4\\x1b[2J" in out
    assert "[bold red]step_2" in out and "step_3[x]" in out
    assert "step_5\\n  step_99" in out and "step_6\\xff" in out
    rows = [line for line in out.splitlines() if "step_" in line]
    assert len(rows) == 1 + len(names), out  # one row per checkpoint: nothing forged


# ------------------------------------------------------------------------------------------------ export


def _limit_file_size(limit: int) -> Any:
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_an_export_whose_index_does_not_fit_names_it_and_leaves_nothing(tmp_path: Path) -> None:
    """Every shard fits under RLIMIT_FSIZE, the index (many long names) does not: the error said only
    "[Errno 27] File too large", naming neither the file nor that nothing was exported."""
    state = {"model": {("n" * 120) + str(i): torch.zeros(1) for i in range(6)}}
    ckpt = _save_one(tmp_path / "run", state)
    out = tmp_path / "hf"
    (out / "config.json").parent.mkdir()
    (out / "config.json").write_text("{}")  # the user's own file beside the export
    argv = _cli_cmd("export", str(ckpt), "--item", "model", "--to", "hf", str(out), "--max-shard-size", "1")
    proc = subprocess.run(
        argv,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        preexec_fn=_limit_file_size(600),
        # Not measured by coverage (CI): its data file, written at exit, would hit the same 600-byte limit and
        # print a traceback of its own.
        env={k: v for k, v in os.environ.items() if k != "COVERAGE_PROCESS_START"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.safetensors.index.json" in lines[0] and "nothing was exported" in lines[0], lines[0]
    assert sorted(os.listdir(out)) == ["config.json"]
    assert not [p for p in tmp_path.iterdir() if ".export-tmp-" in p.name]


SLOW_EXPORT_CHILD = """
import sys
from torch_checkpointing.hf import export_hf
report = export_hf(sys.argv[1], "model", sys.argv[2], max_shard_size="1MB")
print("EXPORTED", len(report.files), flush=True)
"""

_IN_A_NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]
OTHER_NAMESPACE_EXPORT = """
import sys
from torch_checkpointing.hf import export_hf
export_hf(sys.argv[1], "model", sys.argv[2])
print("EXPORTED", flush=True)
"""


def _staging_with_a_shard(parent: Path, deadline: float) -> Path:
    while time.monotonic() < deadline:
        for p in parent.iterdir():
            if ".export-tmp-" in p.name and any(p.iterdir()):
                return p
        time.sleep(0.005)
    raise AssertionError(f"no export staging appeared under {parent}")


def _slow_export(ckpt: Path, out: Path) -> subprocess.Popen[str]:
    """An export in a child process that pauses between shards (SLOW_EXPORT_CHILD)."""
    return subprocess.Popen(
        [sys.executable, "-c", SLOW_EXPORT_CHILD, str(ckpt), str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_an_export_in_another_pid_namespace_never_removes_a_live_exports_staging(tmp_path: Path) -> None:
    """Two containers (pid namespaces) exporting beside each other on a shared volume: each export removes the
    hidden stagings of exports whose pid is gone, and a pid of another namespace (or host) is always "gone"
    there: the second export deleted the first one's staging while it ran, and the first export then failed.

    The first export is stopped (SIGSTOP) once its staging holds a shard; the second runs in a new pid
    namespace beside it; the first, continued, must finish intact."""
    many = {"model": {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(24)}}  # 24 x 1 MiB: 24 shards
    ckpt = _save_one(tmp_path / "run", many)
    small = _save_one(tmp_path / "small")
    exports = tmp_path / "exports"
    exports.mkdir()
    first = _slow_export(ckpt, exports / "a")
    try:
        staging = _staging_with_a_shard(exports, time.monotonic() + SUBPROCESS_TIMEOUT_S)
        stop(first.pid)
        other = subprocess.run(
            [*_IN_A_NEW_PID_NAMESPACE, sys.executable, "-c", OTHER_NAMESPACE_EXPORT, str(small), str(exports / "b")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=SUBPROCESS_TIMEOUT_S,
        )
        assert "EXPORTED" in other.stdout, other.stderr[-3000:]
        assert staging.exists(), "the live export's staging was removed by an export in another pid namespace"
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert first.returncode == 0 and "EXPORTED 25" in out, err[-3000:]
    assert sorted(p.name for p in exports.iterdir()) == ["a", "b"]


def test_ctrl_c_during_an_export_is_one_line_exit_130_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGINT (Ctrl-C) while an export writes its shards printed a KeyboardInterrupt traceback. Now: the export's
    cleanup runs, one line on stderr, exit 130 (128 + SIGINT, what shells expect), and nothing half-written."""
    many = {"model": {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(48)}}  # 48 shards of 1 MiB
    ckpt = _save_one(tmp_path / "run", many)
    exports = tmp_path / "exports"
    exports.mkdir()
    argv = _cli_cmd(
        "export", str(ckpt), "--item", "model", "--to", "hf", str(exports / "hf"), "--max-shard-size", "1MB"
    )
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _staging_with_a_shard(exports, time.monotonic() + SUBPROCESS_TIMEOUT_S)
    finally:
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines() == ["torch-checkpointing export: interrupted"], err
    assert list(exports.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "gc", "ROOT", "--older-than", "nan"],
        ["gc", "ROOT", "--json", "--older-than", "-1"],
        ["--json", "inspect"],
        ["--json", "frobnicate"],
    ],
)
def test_bad_arguments_with_json_give_the_error_document(tmp_path: Path, argv: list[str]) -> None:
    """docs/operations.md: with --json, errors come as {"error": ..., "kind": ...} with exit code 2. Argument
    errors printed only argparse's usage on stderr: a script doing json.load(stdout) got nothing to parse."""
    argv = [str(tmp_path) if a == "ROOT" else a for a in argv]
    proc = subprocess.run(_cli_cmd(*argv), cwd=REPO, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["kind"] == "UsageError" and doc["error"], doc
    assert "usage: torch-checkpointing" in proc.stderr and "error:" in proc.stderr and "Traceback" not in proc.stderr


def test_help_and_bad_arguments_without_json_are_argparse_s(tmp_path: Path) -> None:
    """--help needs no checkpoint, no torch.distributed set up, and exits 0; a bad argument is usage + one error
    line on stderr, exit 2, and nothing on stdout."""
    help_run = subprocess.run(_cli_cmd("prune", "--help"), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert help_run.returncode == 0 and "--keep-last" in help_run.stdout, help_run.stderr
    bad = subprocess.run(_cli_cmd("prune", str(tmp_path), "--keep-last", "x"), cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == "" and "invalid int value: 'x'" in bad.stderr, bad.stderr


def test_two_exports_into_one_directory_move_in_one_after_the_other(tmp_path: Path) -> None:
    """Two exports into one `out` with --overwrite at once moved their files in interleaved (index out, shards
    in, stale shards out, index in), so one's index could end up over a mix of both one's shards: a complete-
    looking export of neither checkpoint. A move-in now holds an exclusive flock on `out`'s parent directory;
    here this test holds it, and the export must wait for it with everything staged and nothing in `out`."""
    import fcntl

    ckpt = _save_one(tmp_path / "run", {"model": {f"w{i}": torch.full((8,), float(i)) for i in range(4)}})
    exports = tmp_path / "exports"
    exports.mkdir()
    fd = os.open(exports, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # what another export's move-in holds
        proc = _slow_export(ckpt, exports / "hf")
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        staged: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None and not staged:
            staged = [p for p in exports.glob(".hf.export-tmp-*") if (p / "model.safetensors.index.json").exists()]
            time.sleep(0.01)
        time.sleep(0.5)  # an export that ignored the lock would have moved in by now
        assert staged and not (exports / "hf").exists(), proc.communicate(timeout=60)
    finally:
        os.close(fd)  # the other move-in is done
    out, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0 and "EXPORTED" in out, err[-3000:]
    assert sorted(p.name for p in exports.iterdir()) == ["hf"]


def test_an_overwrite_replaces_an_export_of_more_than_99999_shards(tmp_path: Path) -> None:
    """Shard names have five digits and more past 99999 shards (`{k:05d}`); an --overwrite export took such a
    folder's shards for someone else's files and refused (or would have left them beside the new export)."""
    import torch

    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.hf import INDEX_FILE_NAME, export_hf

    with CheckpointManager(CheckpointManager.Config.with_sync_save()) as manager:
        manager.save(str(tmp_path / "c"), {"model": {"w": torch.arange(4.0)}})
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model-100000-of-100001.safetensors").write_bytes(b"an earlier export's shard")
    (out / INDEX_FILE_NAME).write_text('{"metadata": {}, "weight_map": {}}')
    report = export_hf(tmp_path / "c", "model", out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(report.files)
