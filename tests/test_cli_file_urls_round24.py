"""Every command refuses a `file://` path the same way, naming the local path the URL names: the one
`CheckpointManager.load` reads for that URL (percent-escapes decoded, `localhost` not a directory).

Before: the suggested path was the URL with its scheme cut off, so `file://localhost/abs/run` suggested
`/localhost/abs/run` and `file:///abs/my%20run` suggested `/abs/my%20run`, neither of them the directory,
while `manager.load` of the same URL read the right one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest
import torch

from torch_checkpointing import CheckpointManager, list_checkpoints
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("round24") / "my run"  # a space: a URL spells it %20
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step in (1, 2):
            manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
    return root


def _urls(path: Path) -> list[str]:
    return [f"file://{quote(str(path))}", f"file://localhost{quote(str(path))}"]


def _commands(run: Path, out: Path) -> list[tuple[list[str], Path]]:
    """(argv with `{}` where the URL goes, the local path the URL names)."""
    ckpt = run / "step_2"
    return [
        (["ls", "{}"], run),
        (["gc", "{}", "--dry-run"], run),
        (["prune", "{}", "--keep-last", "1", "--dry-run"], run),
        (["inspect", "{}"], ckpt),
        (["verify", "{}"], ckpt),
        (["diff", str(run / "step_1"), "{}"], ckpt),
        (["export", "{}", "--item", "model", "--to", "hf", str(out)], ckpt),
    ]


def test_every_command_refuses_a_file_url_naming_the_path_it_names(run: Path, tmp_path: Path) -> None:
    for argv, named in _commands(run, tmp_path / "hf"):
        for url in _urls(named):
            done = subprocess.run(
                [sys.executable, "-m", "torch_checkpointing", *[url if a == "{}" else a for a in argv]],
                capture_output=True,
                text=True,
                timeout=SUBPROCESS_TIMEOUT_S,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2 and len(lines) == 1, (argv, url, done.returncode, done.stderr)
            assert repr(url) in lines[0] and repr(str(named)) in lines[0], (argv, url, lines[0])
            assert done.stdout == "", (argv, url, done.stdout)
    assert not (tmp_path / "hf").exists()


def test_the_listing_api_names_the_same_path_and_the_path_lists(run: Path) -> None:
    for url in _urls(run):
        with pytest.raises(ConfigError) as raised:
            list_checkpoints(url)
        assert repr(str(run)) in str(raised.value), str(raised.value)
    assert [c.step for c in list_checkpoints(run)] == [1, 2]


def test_a_file_url_naming_another_host_is_refused_saying_so() -> None:
    with pytest.raises(ConfigError, match=r"names the host 'elsewhere'"):
        list_checkpoints("file://elsewhere/abs/run")


def test_a_runs_root_passed_for_a_checkpoint_is_said_in_sentences(run: Path) -> None:
    """`inspect ROOT` said "...: no manifest.json: not a checkpoint It holds 2 checkpoint(s) ...": the two
    sentences ran together (a load of the root says "not a checkpoint. It holds ...")."""
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", "inspect", str(run)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2, done.stderr
    assert "not a checkpoint. It holds 2 checkpoint(s)" in done.stderr, done.stderr
