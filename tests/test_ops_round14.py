"""The operations CLI, round 14: `diff` and `verify` answers a user acts on (docs/operations.md: exit 0 means
"intact/identical"; `diff` reports "non-tensor values that differ, and for tensors ... the maximum absolute
difference"; items saved with a resharder are compared as consolidated full tensors).

What each case did before:
* two bit-identical checkpoints holding a NaN (tensor or float leaf): "differs, max abs diff inf", exit 1;
  `[inf, 1]` against `[inf, 2]`: "max abs diff inf"; int64 `2**53` against `2**53 + 1`: "max abs diff 0";
* a resharded item's non-tensor state (an optimizer's param_groups) was never compared: exit 0, identical;
* leaves whose dotted names collide (`{"a.b": x, "a": {"b": y}}`) were merged, the later one winning: a
  difference in the other went unreported;
* a sparse tensor: `diff` died with a torch dispatcher dump, `export` with "unsupported memory format option"
  naming no tensor;
* a file recorded in a format no load reads: `verify` said OK (exit 0) while every load refused it.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_damage_not_newer_round26 import declare_newer_engine
from torch_checkpointing import CheckpointManager, ItemSpec
from torch_checkpointing.cli import main
from torch_checkpointing.dtensor_resharder import DTensorResharder
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig


def _save(path: Path, payload: dict[str, Any], **items: ItemSpec) -> str:
    cfg = CheckpointManager.Config.with_sync_save()
    cfg.items = items
    cfg.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    with pytest.warns(UserWarning, match="plain") if items else contextlib.nullcontext(), CheckpointManager(cfg) as m:
        m.save(str(path), payload)
    return str(path)


def _diff(capsys: pytest.CaptureFixture[str], a: str, b: str) -> tuple[int, list[dict[str, Any]]]:
    code = main(["--json", "diff", a, b])
    return code, json.loads(capsys.readouterr().out)["differences"]


def test_a_checkpoint_holding_nan_is_identical_to_its_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    payload = {"model": {"w": torch.tensor([1.0, float("nan"), float("inf")]), "lr": float("nan")}}
    a, b = _save(tmp_path / "a", payload), _save(tmp_path / "b", payload)
    assert _diff(capsys, a, b) == (0, [])


@pytest.mark.parametrize(
    ("left", "right", "detail"),
    [
        (torch.tensor([float("inf"), 1.0]), torch.tensor([float("inf"), 2.0]), "max abs diff 1"),
        (torch.tensor([2**53], dtype=torch.int64), torch.tensor([2**53 + 1], dtype=torch.int64), "max abs diff 1"),
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")]), "1 NaN where the other holds a number"),
        (torch.tensor([-(2**63)], dtype=torch.int64), torch.tensor([2**63 - 1], dtype=torch.int64), "1.84467e+19"),
    ],
)
def test_diff_reports_the_real_largest_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], left: torch.Tensor, right: torch.Tensor, detail: str
) -> None:
    a, b = _save(tmp_path / "a", {"model": {"x": left}}), _save(tmp_path / "b", {"model": {"x": right}})
    code, rows = _diff(capsys, a, b)
    assert code == 1 and [r["leaf"] for r in rows] == ["x"], rows
    assert detail in rows[0]["detail"], rows


def test_a_resharded_items_non_tensor_state_is_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    groups_a = [{"lr": 0.1, "betas": [0.9, 0.999], "params": [0]}]
    groups_b = [{"lr": 0.5, "betas": [0.9, 0.999], "params": [0]}]
    state = {"state": {0: {"exp_avg": torch.ones(4)}}}
    a = _save(tmp_path / "a", {"opt": {**state, "param_groups": groups_a}}, opt=ItemSpec(resharder=DTensorResharder()))
    b = _save(tmp_path / "b", {"opt": {**state, "param_groups": groups_b}}, opt=ItemSpec(resharder=DTensorResharder()))
    code, rows = _diff(capsys, a, b)
    assert code == 1 and [(r["leaf"], r["detail"]) for r in rows] == [("param_groups.0.lr", "0.1 vs 0.5")], rows


def test_leaves_whose_dotted_names_collide_are_each_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = _save(tmp_path / "a", {"model": {"a.b": torch.zeros(2), "a": {"b": torch.ones(2)}}})
    b = _save(tmp_path / "b", {"model": {"a.b": torch.full((2,), 6.0), "a": {"b": torch.ones(2)}}})
    code, rows = _diff(capsys, a, b)
    assert code == 1 and len(rows) == 1 and rows[0]["status"] == "differs", rows
    assert "a.b" in rows[0]["leaf"] and "max abs diff 6" in rows[0]["detail"], rows


def test_sparse_tensors_are_compared_and_refused_by_export_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    other = torch.tensor([[0.0, 2.0], [5.0, 0.0]])
    a = _save(tmp_path / "a", {"model": {"adj": dense.to_sparse()}})
    same = _save(tmp_path / "same", {"model": {"adj": dense.to_sparse()}})
    b = _save(tmp_path / "b", {"model": {"adj": other.to_sparse()}})
    assert _diff(capsys, a, same) == (0, [])
    code, rows = _diff(capsys, a, b)
    assert code == 1 and "max abs diff 2" in rows[0]["detail"], rows
    assert main(["export", a, "--item", "model", "--to", "hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'adj'" in err and "sparse" in err and "to_dense" in err, err
    assert not (tmp_path / "out").exists()


def test_verify_fails_a_file_recorded_in_a_format_no_load_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = Path(_save(tmp_path / "ck", {"model": {"w": torch.ones(2)}}))
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["items"]["model"]["0"]["format"] = {"type": "ZstdTorchSerialization"}
    declare_newer_engine(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    # Never OK; a newer engine's format is no damage either (exit 2, round 26), a name no engine writes is.
    assert main(["verify", str(root)]) == 2
    err = capsys.readouterr().err
    assert "model_0.pt" in err and "ZstdTorchSerialization" in err, err
    manifest["items"]["model"]["0"]["format"] = {"type": "zstd.TorchSerialization"}
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "model_0.pt" in out and "zstd.TorchSerialization" in out, out


def test_prune_by_a_metric_no_checkpoint_records_never_deletes_the_best_by_the_name_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--metric lsos` (a typo of `loss`): every checkpoint was "not best", and the best by loss was deleted.

    The pass is no longer refused (that also refused it to jobs before their first eval, whose checkpoints then
    piled up): the best by `loss`, the metric the checkpoints record, is kept in place of the best by `lsos`,
    and the output says so, naming both."""
    cfg = CheckpointManager.Config.with_sync_save()
    with CheckpointManager(cfg) as m:
        for step, loss in ((1, 0.1), (2, 0.5), (3, 0.9), (4, 0.7)):
            m.save(str(tmp_path / f"step_{step}"), {"model": {"w": torch.ones(2)}}, metrics={"loss": loss})
    code = main(["prune", str(tmp_path), "--keep-best", "1", "--metric", "lsos", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0 and "'lsos'" in out and "'loss'" in out, out
    assert "would delete 2 checkpoint(s): step_2, step_3" in out, out
    assert main(["prune", str(tmp_path), "--keep-best", "1", "--metric", "lsos"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_4"]  # the best by loss, and the newest
    assert main(["prune", str(tmp_path), "--keep-best", "1", "--metric", "loss"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_4"]


def test_a_trailing_number_in_other_scripts_digits_is_not_a_step(tmp_path: Path) -> None:
    from torch_checkpointing import list_checkpoints

    cfg = CheckpointManager.Config.with_sync_save()
    with CheckpointManager(cfg) as m:
        m.save(str(tmp_path / "step_\u0663\u0660\u0660"), {"model": {"w": torch.ones(2)}})  # Arabic-Indic 300
        m.save(str(tmp_path / "step_7"), {"model": {"w": torch.ones(2)}})
    assert [(Path(c.path).name, c.step) for c in list_checkpoints(str(tmp_path))] == [
        ("step_\u0663\u0660\u0660", None),
        ("step_7", 7),
    ]


def test_export_flushes_its_files_and_directories_before_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut after `export` returned could leave an index naming shards whose bytes were never on disk."""
    import os

    from torch_checkpointing.hf import export_hf

    cfg = CheckpointManager.Config.with_sync_save()
    with CheckpointManager(cfg) as m:
        m.save(str(tmp_path / "ck"), {"model": {"a": torch.ones(4), "b": torch.zeros(4)}})
    flushed: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    export_hf(str(tmp_path / "ck"), "model", str(tmp_path / "out"), max_shard_size=16)
    names = [Path(p).name for p in flushed]
    assert names.count("model.safetensors.index.json") == 1, flushed
    assert sum(n.startswith("model-0000") for n in names) == 2, flushed
    assert str(tmp_path) in flushed, flushed  # the parent, after the rename into place


def test_prune_keeps_a_checkpoint_someone_wrote_into_after_its_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check for files a checkpoint does not list ran, then the rename to trash, then the removal: a file
    written between the check and the rename (an eval job's results beside the weights) was deleted with it.
    The other writer is this wrapper, which writes once, right after the first check returns."""
    from torch_checkpointing import RetentionPolicy, retention

    cfg = CheckpointManager.Config.with_sync_save()
    with CheckpointManager(cfg) as m:
        for step in (1, 2):
            m.save(str(tmp_path / f"step_{step}"), {"model": {"w": torch.zeros(1)}})
    real = retention.files_not_listed
    wrote: list[Path] = []

    def check_then_another_process_writes(storage: Any, path: Any) -> list[str]:
        found = real(storage, path)
        if not wrote:
            wrote.append(Path(path) / "eval.json")
            wrote[0].write_text('{"acc": 0.9}')
        return found

    monkeypatch.setattr(retention, "files_not_listed", check_then_another_process_writes)
    report = retention.prune(str(tmp_path), RetentionPolicy(keep_last=1))
    assert report.deleted == [] and len(report.failed) == 1 and "eval.json" in report.failed[0][1], report
    assert (tmp_path / "step_1" / "eval.json").read_text() == '{"acc": 0.9}'
