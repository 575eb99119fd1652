"""The CLI with directory names that are not UTF-8 (a Linux name is bytes; Python gives its undecodable bytes
as lone surrogates, os.fsdecode), through the real command (`python -m torch_checkpointing`).

Before: `--json` wrote such a name as a `"\\udcff"` escape, which strict JSON parsers refuse or replace and
which Python's own json.loads hands back as a str that cannot be encoded (`.encode("utf-8")` raised); the
text output crashed mid-table (exit 2) when stdout could not encode a name (PYTHONIOENCODING=ascii).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch
BYTES_NAME = b"ckpt-\xff"  # a checkpoint saved into a directory whose name is not UTF-8
LEFTOVER = b".ckpt-\xfe.tmp-0123456789ab-1"  # a temporary a killed save left, named likewise
ACCENTED = "ckpt-\u00e9"  # UTF-8, but not ASCII


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("names") / "run"
    saves = [(os.fsdecode(BYTES_NAME), 1), (ACCENTED, 2), ("step_3", 3)]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for name, step in saves:
            manager.save(str(run / name), {"model": {"w": torch.full((4,), float(step))}}, step=step)
    leftover = os.fsencode(run) + b"/" + LEFTOVER
    os.mkdir(leftover)
    old = time.time() - 3 * 86400  # past --older-than's default: gc removes it
    os.utime(leftover, (old, old))
    return run


def _cli(*args: str | bytes, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *args],
        cwd=REPO,
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, **(env or {})},
    )


def _strings(doc: Any) -> list[str]:
    """Every string of a JSON document, keys included."""
    if isinstance(doc, str):
        return [doc]
    if isinstance(doc, dict):
        return [s for k, v in doc.items() for s in [*_strings(k), *_strings(v)]]
    if isinstance(doc, list):
        return [s for v in doc for s in _strings(v)]
    return []


def _document(*args: str | bytes) -> Any:
    done = _cli("--json", *args)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    doc = json.loads(done.stdout)
    for text in _strings(doc):
        text.encode("utf-8")  # raised UnicodeEncodeError on "\udcff" before
    return doc


def _named(entries: list[dict[str, Any]], name: bytes) -> dict[str, Any]:
    found = [e for e in entries if bytes.fromhex(e.get("path_hex", "")).endswith(b"/" + name)]
    assert len(found) == 1, entries
    return found[0]


def test_json_names_every_undecodable_byte_escaped_with_the_exact_bytes_beside(root: Path) -> None:
    listed = _document("ls", str(root))
    entry = _named(listed["checkpoints"], BYTES_NAME)
    assert entry["name"] == "ckpt-\\xff" and bytes.fromhex(entry["name_hex"]) == BYTES_NAME
    assert os.path.isdir(bytes.fromhex(entry["path_hex"]))  # the bytes to open it by
    assert [e["name"] for e in listed["checkpoints"]] == ["ckpt-\\xff", ACCENTED, "step_3"]
    assert "name_hex" not in listed["checkpoints"][1]  # a name that is UTF-8 is written as it is, alone
    assert _named(listed["leftovers"], LEFTOVER)["checkpoint_name"] == "ckpt-\\xfe"

    inspected = _document("inspect", os.fsencode(root) + b"/" + BYTES_NAME)
    assert bytes.fromhex(inspected["path_hex"]).endswith(BYTES_NAME)

    pruned = _document("prune", str(root), "--keep-last", "2", "--dry-run")
    assert bytes.fromhex(_named(pruned["deleted"], BYTES_NAME)["path_hex"]) == os.fsencode(root) + b"/" + BYTES_NAME

    collected = _document("gc", str(root), "--dry-run")
    assert _named(collected["removed"], LEFTOVER)["kind"] == "temporary"


@pytest.mark.parametrize(
    "env",
    [{"LC_ALL": "C.UTF-8"}, {"LC_ALL": "C"}, {"LC_ALL": "C.UTF-8", "PYTHONIOENCODING": "ascii"}],
    ids=["utf-8", "C", "ascii"],
)
def test_text_output_shows_every_name_whatever_stdout_can_encode(root: Path, env: dict[str, str]) -> None:
    """An undecodable byte is shown as `\\xff`; a character stdout cannot encode as `\\u00e9`."""
    accented = "ckpt-\\u00e9" if "PYTHONIOENCODING" in env else ACCENTED
    for args in (["ls", str(root)], ["prune", str(root), "--keep-last", "1", "--dry-run"]):
        done = _cli(*args, env=env)
        out = done.stdout.decode("utf-8")
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
        assert "ckpt-\\xff" in out and accented in out, out


def test_the_entry_point_reads_its_stop_names_without_importing_torch() -> None:
    """`python -m torch_checkpointing` holds Ctrl-C and SIGTERM while it imports the CLI (and torch); what it
    needs before then, the names of a stop, comes from a module that imports no torch."""
    probe = (
        "import sys, torch_checkpointing.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
