"""Operations on local disk under concurrency and kills (round 16): retention, gc and discovery against real
processes, each defect with the test that failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from torch_checkpointing import CheckpointManager, RetentionPolicy, latest_checkpoint, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.retention import collect_garbage, prune


def _save(root: Path, steps: list[int], items: int = 1) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in steps:
            manager.save(str(root / f"step_{step}"), {f"i{j}": {"w": torch.ones(2)} for j in range(items)})


def _dead_pid() -> int:
    """A pid that was just used and is gone (what a killed prune leaves in its trash names)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _folder(path: Path, files: dict[str, str]) -> None:
    path.mkdir()
    for name, text in files.items():
        (path / name).write_text(text)


def test_gc_never_removes_a_folder_named_like_ours_that_holds_another_tools_manifest(tmp_path: Path) -> None:
    """operations.md, "Only ours": "a `.tmp-`/`.old_`/`.trash-` directory is removed only when it holds *our*
    `manifest.json` ... so a folder that merely has one of our names is yours". Before, any file called
    manifest.json (a browser extension's, a dataset's) made such a folder "ours": gc deleted it with the user's
    files in it — a `.trash-` one at once, a `.tmp-` one once past --older-than."""
    root = tmp_path / "run"
    _save(root, [1])
    foreign = {"manifest.json": json.dumps({"name": "an extension", "version": "1.0"}), "user.txt": "mine"}
    trash = root / f".data.trash-{_dead_pid()}-ab12"
    tmp = root / ".cache.tmp-abc123-2"
    _folder(trash, foreign)
    _folder(tmp, foreign)
    report = collect_garbage(root, unowned_after_s=0)
    assert (trash / "user.txt").read_text() == "mine", report
    assert (tmp / "user.txt").read_text() == "mine", report
    assert report.removed == [] and report.failed == []
    kept = {Path(lo.path).name: why for lo, why in report.kept}
    assert "delete it by hand" in kept[trash.name] and "delete it by hand" in kept[tmp.name]
    assert [c.name for c in list_checkpoints(root)] == ["step_1"]


def test_gc_never_removes_a_folder_named_like_ours_that_holds_another_tools_incomplete_file(tmp_path: Path) -> None:
    """The same promise for the marker: our `.incomplete` is empty (where saves rename) or a save's claim (a
    small JSON object naming its token). A download tool's `.incomplete` (its progress, say) made a folder
    named like ours "ours", and gc deleted it with the user's files."""
    root = tmp_path / "run"
    _save(root, [1])
    foreign = {".incomplete": "downloaded 45% of data.bin\n", "user.txt": "mine"}
    trash = root / f".data.trash-{_dead_pid()}-ab12"
    _folder(trash, foreign)
    ours = root / f".step_9.trash-{_dead_pid()}-cd34"
    _folder(ours, {".incomplete": "", "model_0.pt": "x"})  # what a killed delete of ours leaves
    report = collect_garbage(root, unowned_after_s=0)
    assert (trash / "user.txt").read_text() == "mine", report
    assert [Path(lo.path).name for lo in report.removed] == [ours.name], report
    assert "delete it by hand" in {Path(lo.path).name: why for lo, why in report.kept}[trash.name]


_JOB = textwrap.dedent(
    """
    import sys, time, torch
    from torch_checkpointing import CheckpointManager, RetentionPolicy
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    root, n = sys.argv[1], int(sys.argv[2])
    config = CheckpointManager.Config(save=SyncCheckpointSaverConfig(), retention=RetentionPolicy(keep_last=2))
    with CheckpointManager(config) as manager:
        for step in range(1, n + 1):
            manager.save(f"{root}/step_{step}", {"model": {"w": torch.full((64,), float(step))}})
            time.sleep(0.05)
    """
)

# A second process: prune, gc and ls (the CLI's own entry point, not a re-implementation) in a loop until told to
# stop; every answer that breaks the contract is written out.
_OPERATOR = textwrap.dedent(
    """
    import contextlib, io, json, os, sys
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    manager = CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig()))
    from torch_checkpointing.cli import main
    root, stop = sys.argv[1], sys.argv[2]
    seen, bad, rounds = False, [], 0
    def run(*argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["--json", *argv])
        return rc, json.loads(out.getvalue())
    while not os.path.exists(stop) or rounds < 3:
        rounds += 1
        for argv in (("prune", root, "--keep-last", "2"), ("gc", root)):
            rc, doc = run(*argv)
            if rc != 0:
                bad.append([argv[0], rc, doc])
        rc, doc = run("ls", root)
        latest = doc.get("latest")
        if rc != 0 or doc.get("damaged") or (latest is None and seen):
            bad.append(["ls", rc, doc])
        if latest is not None:
            seen = True
            try:
                manager.load(latest)
            except Exception as exc:  # a deletion after the listing is no fault; a damaged one there is
                if os.path.lexists(latest):
                    bad.append(["load", latest, repr(exc)])
    manager.close()
    print(json.dumps({"rounds": rounds, "bad": bad[:5]}))
    """
)


def test_prune_gc_and_ls_in_a_second_process_never_break_a_saving_job(tmp_path: Path) -> None:
    """operations.md, Retention: "the newest committed checkpoint is always kept"; "a kill during the removal
    ... never a half-deleted directory that still looks committed"; gc "never [removes] one that a live writer
    still owns". A job saves every 50 ms with keep_last=2 while another process runs prune, gc and ls: every
    command succeeds, `ls` never shows a damaged row nor "no resume point" once one existed, and the job's
    last two checkpoints survive whole."""
    root = tmp_path / "run"
    root.mkdir()
    stop = tmp_path / "stop"
    operator = subprocess.Popen(
        [sys.executable, "-c", _OPERATOR, str(root), str(stop)], stdout=subprocess.PIPE, text=True
    )
    try:
        subprocess.run([sys.executable, "-c", _JOB, str(root), "40"], check=True, timeout=120)
    finally:
        stop.touch()
    out, _ = operator.communicate(timeout=120)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bad"] == [] and result["rounds"] >= 3, result
    assert [c.name for c in list_checkpoints(root)] == ["step_39", "step_40"]
    assert sorted(os.listdir(root)) == ["step_39", "step_40"]  # nothing left behind
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "step_40"
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        assert torch.equal(manager.load(latest.path)["model"]["w"], torch.full((64,), 40.0))


def test_a_prune_killed_mid_delete_leaves_trash_that_no_listing_counts_and_gc_removes(tmp_path: Path) -> None:
    """operations.md, "Crash-safe deletion": "A kill during the removal leaves a trash directory (collected by
    the next pass or `gc`), never a half-deleted directory that still looks committed." The prune runs as the
    CLI in its own process and gets SIGKILL once its trash appears (a checkpoint of 400 files takes a while)."""
    root = tmp_path / "run"
    _save(root, [1, 2], items=400)
    proc = subprocess.Popen([sys.executable, "-m", "torch_checkpointing", "prune", str(root), "--keep-last", "1"])
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if any(".trash-" in name for name in os.listdir(root)):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the prune finished before it could be killed"
    assert [c.name for c in list_checkpoints(root)] == ["step_2"]
    latest = latest_checkpoint(root)
    assert latest is not None and latest.name == "step_2"
    report = collect_garbage(root)
    assert [lo.kind for lo in report.removed] == ["trash"] and report.failed == []
    assert sorted(os.listdir(root)) == ["step_2"]


def test_keep_best_skips_nan_and_missing_metrics_counts_infinities_and_breaks_ties_to_the_newer(
    tmp_path: Path,
) -> None:
    """operations.md: "a checkpoint without the metric, or with NaN, is never 'best'"; ties go to the newer one;
    `keep_every_n_steps` keeps by step, so an id without one (step None) is not kept by it."""
    root = tmp_path / "run"
    metrics: list[tuple[str, int | None, dict[str, float] | None]] = [
        ("nan", 1, {"loss": float("nan")}),
        ("neg_inf", 2, {"loss": float("-inf")}),
        ("none", 3, None),
        ("tie_old", 4, {"loss": 0.5}),
        ("tie_new", 5, {"loss": 0.5}),
        ("pos_inf", 6, {"loss": float("inf")}),
        ("stepless", None, {"loss": 0.1}),
        ("other", 8, {"acc": 1.0}),
    ]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for name, step, recorded in metrics:
            manager.save(str(root / name), {"model": {"w": torch.ones(2)}}, step=step, metrics=recorded)

    def kept(policy: RetentionPolicy) -> set[str]:
        doomed = prune(root, policy, dry_run=True).deleted
        return {c.name for c in list_checkpoints(root)} - {c.name for c in doomed}

    assert kept(RetentionPolicy(keep_best=2, metric="loss", mode="min")) == {"neg_inf", "stepless", "other"}
    assert kept(RetentionPolicy(keep_best=2, metric="loss", mode="max")) == {"pos_inf", "tie_new", "other"}
    assert kept(RetentionPolicy(keep_every_n_steps=1)) == {n for n, s, _ in metrics if s is not None}


def test_prune_and_gc_leave_every_link_file_and_foreign_folder_under_the_root(tmp_path: Path) -> None:
    """operations.md: a symbolic link under the root is never followed ("neither listing, retention nor gc
    follows one out of the root"); "What is not a committed checkpoint ... is never deleted"; a checkpoint that
    holds files not its own is left, with a NOT DELETED line."""
    root, outside = tmp_path / "run", tmp_path / "outside"
    _save(root, [1, 2, 3])
    _save(outside, [9])
    (root / "notes.txt").write_text("n")
    _folder(root / "data", {"a.bin": "a"})
    _folder(root / "other", {"manifest.json": "{}"})
    (root / "latest").symlink_to("step_3")
    (root / "step_0").symlink_to(outside / "step_9")
    linked_trash = f".linked.trash-{_dead_pid()}-ef"
    (root / linked_trash).symlink_to(outside / "step_9")
    (root / "step_2" / "eval").symlink_to(outside)  # a link an eval job put into a checkpoint
    before = sorted(os.listdir(outside / "step_9"))
    report = prune(root, RetentionPolicy(keep_last=1))
    assert [c.name for c in report.deleted] == ["step_1"]
    assert [c.name for c, _ in report.failed] == ["step_2"]
    gc = collect_garbage(root, unowned_after_s=0)
    assert gc.removed == [] and gc.failed == []
    left = ["notes.txt", "data", "other", "latest", "step_0", linked_trash, "step_2", "step_3"]
    assert sorted(os.listdir(root)) == sorted(left)
    assert sorted(os.listdir(outside / "step_9")) == before and os.path.islink(root / "step_2" / "eval")
