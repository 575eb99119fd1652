"""Operations (ls, gc, prune, export and their library calls) attacked as a script with a wrong argument would.

Each test here failed before its fix: with `--json`, a Ctrl-C or SIGTERM (during the command or while the CLI
imported torch) left stdout empty, no JSON document for the script to parse; an empty root
(`torch-checkpointing prune "$ROOT" --keep-last 1` with ROOT unset, or `prune(os.environ.get("ROOT", ""),
policy)`) was taken for the current directory, and the checkpoints there were deleted.
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager, cli, latest_checkpoint, list_checkpoints
from torch_checkpointing import __main__ as entry
from torch_checkpointing.cli import main
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.discovery import list_leftovers
from torch_checkpointing.retention import RetentionPolicy, apply_retention, collect_garbage, prune


def _save_run(root: Path, steps: tuple[int, ...] = (1, 2, 3)) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in steps:
            manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}}, step=step)


@pytest.fixture
def cwd_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Checkpoints in the current directory, where an empty root used to point."""
    _save_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _main(argv: list[str]) -> int:
    """main()'s exit code; bad arguments exit as argparse's own do (SystemExit(2), after the JSON document)."""
    try:
        return main(argv)
    except SystemExit as exc:
        assert isinstance(exc.code, int)
        return exc.code


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "", "--keep-last", "1"],
        ["gc", ""],
        ["ls", ""],
        ["inspect", ""],
        ["diff", "", "step_3"],
        ["export", "step_3", "--item", "model", "--to", "hf", ""],
    ],
)
def test_an_empty_path_argument_is_a_usage_error_and_touches_nothing(
    cwd_run: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    before = _names(cwd_run)
    code = _main(["--json", *argv])
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 2, doc
    assert doc["kind"] == "UsageError" and "empty" in doc["error"] and "'.'" in doc["error"], doc
    assert _names(cwd_run) == before


def test_verify_of_an_empty_path_answers_no_and_names_the_fix(
    cwd_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _main(["--json", "verify", ""])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["kind"] == "UsageError" and "'.'" in doc["error"], doc


@pytest.mark.parametrize(
    "call",
    [
        lambda: list_checkpoints(""),
        lambda: latest_checkpoint(""),
        lambda: list_leftovers(""),
        lambda: collect_garbage(""),
        lambda: prune("", RetentionPolicy(keep_last=1)),
        lambda: apply_retention("", RetentionPolicy(keep_last=1)),
    ],
)
def test_an_empty_root_is_refused_by_the_library_and_deletes_nothing(cwd_run: Path, call: Callable[[], Any]) -> None:
    before = _names(cwd_run)
    with pytest.raises(ValueError, match=r"empty.*'\.'"):
        call()
    assert _names(cwd_run) == before


def test_the_current_directory_spelt_as_a_dot_still_works(cwd_run: Path) -> None:
    assert [c.step for c in list_checkpoints(".")] == [1, 2, 3]
    assert [c.step for c in prune(".", RetentionPolicy(keep_last=1)).deleted] == [1, 2]


@pytest.mark.parametrize(
    ("raised", "code", "kind"),
    [(KeyboardInterrupt, 130, "KeyboardInterrupt"), (cli.Terminated, 143, "Terminated")],
)
def test_an_interrupted_command_with_json_still_prints_one_json_document(
    cwd_run: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    raised: type[BaseException],
    code: int,
    kind: str,
) -> None:
    def interrupted(*_args: object, **_kwargs: object) -> object:
        raise raised

    monkeypatch.setattr(cli, "current_resume_point", interrupted)
    assert _main(["--json", "ls", "."]) == code
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["kind"] == kind and doc["error"], doc
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    # without --json: the one line on stderr, and nothing on stdout, as before
    assert _main(["ls", "."]) == code
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured


@pytest.mark.parametrize(("signum", "kind"), [(signal.SIGINT, "KeyboardInterrupt"), (signal.SIGTERM, "Terminated")])
@pytest.mark.parametrize("json_flag", [True, False])
def test_a_signal_while_the_cli_starts_with_json_still_prints_one_json_document(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    signum: signal.Signals,
    kind: str,
    json_flag: bool,
) -> None:
    def held_import(held: list[int]) -> Callable[[], int]:
        held.append(signum)
        return lambda: 0

    monkeypatch.setattr(entry, "_import_cli_holding", held_import)
    monkeypatch.setattr(sys, "argv", ["torch-checkpointing", "ls", ".", *(["--json"] if json_flag else [])])
    assert entry.run() == 128 + signum
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    if json_flag:
        doc = json.loads(captured.out)
        assert doc["kind"] == kind and doc["error"], doc
    else:
        assert captured.out == ""


def test_gc_of_a_checkpoint_instead_of_its_root_says_so(
    cwd_run: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """`ls` and `prune` of a checkpoint warn naming the parent to pass; `gc` said "removed 0 leftover(s)", and the
    run's real leftovers beside it stayed, with nothing said."""
    leftover = cwd_run / ".step_4.tmp-abc-1"
    leftover.mkdir()
    with caplog.at_level("WARNING", logger="torch_checkpointing"):
        assert _main(["gc", str(cwd_run / "step_3")]) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any("is itself a checkpoint" in m and f"pass its parent directory {cwd_run}" in m for m in said), said
    assert leftover.is_dir()
