"""Retention with `keep_best` while no checkpoint records its metric (docs/operations.md, Retention).

Before, such a pass was refused whole with a ConfigError (the guard against a misspelt metric, `lsos`, which
took every checkpoint for "not best" and deleted the best by `loss`). A job that records its metric only at
eval saves is in that state until its first eval: every pass after a commit was refused (one WARNING with a
traceback per save), so `keep_last` was never applied, nor gc, and checkpoints piled up until the disk filled.
Now the pass runs: while no checkpoint records the metric, the best by each metric they do record is kept in
its place (so a misspelt name still deletes no checkpoint that is best by the name meant), the other rules
apply, and the job is told once.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.cli import main
from torch_checkpointing.retention import RetentionPolicy, prune
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

LOGGER = "torch_checkpointing"


def _config(policy: RetentionPolicy | None, async_save: bool = False) -> CheckpointManager.Config:
    cfg = CheckpointManager.Config.with_async_save() if async_save else CheckpointManager.Config.with_sync_save()
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    cfg.retention = policy
    return cfg


def _save_all(root: Path, saves: list[tuple[int, dict[str, float] | None]], policy: RetentionPolicy | None) -> None:
    with CheckpointManager(_config(policy)) as m:
        for step, metrics in saves:
            m.save(str(root / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}}, metrics=metrics)


def _steps(root: Path) -> list[int | None]:
    return [c.step for c in list_checkpoints(root)]


def _ours(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER) and r.levelno == level]


@pytest.mark.parametrize("async_save", [False, True])
def test_keep_last_applies_before_the_first_eval_records_the_metric(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, async_save: bool
) -> None:
    """Metrics only at eval saves (every fourth): before the first, every pass was refused and nothing was
    deleted; after it, the saves between evals go by keep_last and the best eval is kept."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = tmp_path / "run"
    policy = RetentionPolicy(keep_last=3, keep_best=1, metric="loss")
    with CheckpointManager(_config(policy, async_save)) as m:
        for step in range(1, 7):
            m.save(str(root / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
    assert _steps(root) == [4, 5, 6]
    assert not _ours(caplog, logging.WARNING), _ours(caplog, logging.WARNING)
    told = [m for m in _ours(caplog, logging.INFO) if "'loss'" in m and "records" in m]
    assert len(told) == 1, told  # the normal state before a first eval: told once, at INFO, not per save
    assert "metrics={'loss': value}" in told[0], told[0]

    losses = {8: 0.5, 12: 0.9, 16: 0.7}  # eval saves; step_8 stays the best
    _save_all(root, [(s, {"loss": losses[s]} if s in losses else None) for s in range(7, 19)], policy)
    assert _steps(root) == [8, 16, 17, 18]
    assert not _ours(caplog, logging.WARNING), _ours(caplog, logging.WARNING)


def test_a_misspelt_metric_keeps_the_best_by_the_name_meant_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`metric="lsos"` beside saves recording `loss`: keep_last applies, and the best by `loss` (the only name
    recorded) is kept, as `metric="loss"` keeps it; one WARNING for the whole job names both names and the fix."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = tmp_path / "run"
    losses = [0.1, 0.9, 0.8, 0.7, 0.6, 0.5]
    _save_all(
        root,
        [(s, {"loss": v}) for s, v in enumerate(losses, 1)],
        RetentionPolicy(keep_last=2, keep_best=1, metric="lsos"),
    )
    assert _steps(root) == [1, 5, 6]
    warned = _ours(caplog, logging.WARNING)
    assert len(warned) == 1, warned
    assert "'lsos'" in warned[0] and "'loss'" in warned[0] and "fix the metric name" in warned[0], warned[0]


def test_a_misspelt_metric_in_a_job_that_records_metrics_at_evals_only_is_warned_at_the_first_eval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Told at INFO while no metric is recorded at all must not use up the WARNING a misspelt name gets once
    the first eval records the name meant."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = tmp_path / "run"
    saves: list[tuple[int, dict[str, float] | None]] = [(1, None), (2, None), (3, {"loss": 0.2}), (4, None), (5, None)]
    _save_all(root, saves, RetentionPolicy(keep_last=1, keep_best=1, metric="lsos"))
    assert _steps(root) == [3, 5]
    infos = [m for m in _ours(caplog, logging.INFO) if "'lsos'" in m]
    warned = _ours(caplog, logging.WARNING)
    assert len(infos) == 1 and len(warned) == 1 and "'loss'" in warned[0], (infos, warned)


def test_a_metric_recorded_at_every_save_does_not_keep_them_all_before_the_first_eval(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`metric="val_loss"` recorded at evals, `train_loss` at every save: keeping every checkpoint that records
    some metric would have filled the disk as the refusal did; the best by `train_loss` is kept, and keep_last."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    root = tmp_path / "run"
    policy = RetentionPolicy(keep_last=2, keep_best=1, metric="val_loss")
    train = [0.9, 0.3, 0.8, 0.7, 0.6, 0.5]
    _save_all(root, [(s, {"train_loss": v}) for s, v in enumerate(train, 1)], policy)
    assert _steps(root) == [2, 5, 6]
    (warned,) = _ours(caplog, logging.WARNING)
    assert "'val_loss'" in warned and "'train_loss'" in warned and "eval" in warned, warned

    _save_all(
        root, [(7, {"train_loss": 0.4, "val_loss": 2.0}), (8, {"train_loss": 0.1}), (9, {"train_loss": 0.2})], policy
    )
    assert _steps(root) == [7, 8, 9]  # ranked by val_loss now: step_2 was best by train_loss only


def test_prune_api_and_cli_report_the_metric_no_checkpoint_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI runs the same pass (a dry run shows what it would delete) and says why, in text and in --json;
    `prune` reports it in `PruneReport.metric_not_recorded`."""
    root = tmp_path / "run"
    _save_all(root, [(s, {"loss": v}) for s, v in enumerate([0.1, 0.9, 0.8, 0.7], 1)], None)
    report = prune(root, RetentionPolicy(keep_last=1, keep_best=1, metric="lsos"), dry_run=True)
    assert [c.step for c in report.deleted] == [2, 3]
    assert report.metric_not_recorded is not None and "'lsos'" in report.metric_not_recorded
    assert (
        prune(root, RetentionPolicy(keep_last=1, keep_best=1, metric="loss"), dry_run=True).metric_not_recorded is None
    )

    argv = ["prune", str(root), "--keep-last", "1", "--keep-best", "1", "--metric", "lsos"]
    assert main(["--json", *argv, "--dry-run"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in doc["deleted"]] == ["step_2", "step_3"] and _steps(root) == [1, 2, 3, 4]
    assert "'lsos'" in doc["metric_not_recorded"] and "'loss'" in doc["metric_not_recorded"], doc
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "deleted 2 checkpoint(s): step_2, step_3" in out and "warning:" in out and "'lsos'" in out, out
    assert _steps(root) == [1, 4]


def test_prune_of_checkpoints_recording_no_metrics_applies_the_other_rules(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    _save_all(root, [(s, None) for s in range(1, 5)], None)
    assert main(["prune", str(root), "--keep-last", "2", "--keep-best", "1", "--metric", "loss"]) == 0
    out = capsys.readouterr().out
    assert "deleted 2 checkpoint(s)" in out and "warning:" in out and "records any metrics yet" in out, out
    assert _steps(root) == [3, 4]
