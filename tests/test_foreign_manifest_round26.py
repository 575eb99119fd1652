"""Another tool's folder under a root is no damaged checkpoint, whatever its `manifest.json` holds.

Before: a directory whose `manifest.json` was empty, text that is not JSON, or a JSON array (a build tool's, a
download's) was listed by `ls --json` under "damaged", `verify` said FAILED (exit 1) and a load raised
`CorruptCheckpointError`; a script that deletes damaged checkpoints deleted another tool's folder. A JSON object
without our `kind` was already told apart. Now one rule (`parse_manifest`) decides: a manifest that does not parse
is ours, damaged, when it is empty or its bytes name a field of ours (a write cut short, changed bytes); anything
else is `ForeignManifestError`, the folder not a checkpoint: left out of listings, `latest`, prune and gc, `verify`
exit 2.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

from torch_checkpointing import CheckpointManager, cli, latest_checkpoint
from torch_checkpointing.errors import CorruptCheckpointError, ForeignManifestError
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

_FOREIGN = {  # none a JSON object, none naming a field of ours, none empty (what a crash leaves of ours)
    "text": b"name: my-extension\nversion: 3\n",
    "array": b'["a.js", "b.js"]',
    "number": b"42",
}


def _manager() -> CheckpointManager:
    config = CheckpointManager.Config.with_sync_save()
    config.storage_config = LocalFileSystemStorageConfig(use_direct_io=False)
    return CheckpointManager(config)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(list(argv))
    return code, out.getvalue()


@pytest.mark.parametrize("kind", sorted(_FOREIGN))
def test_another_tools_folder_is_not_called_damaged(tmp_path: Path, kind: str) -> None:
    """Defect: `ls --json` listed step_9 under "damaged" ("manifest.json is not valid JSON" / "is not a JSON
    object"), `verify` exited 1 (FAILED) and load raised CorruptCheckpointError."""
    with _manager() as m:
        for step in (1, 2):
            m.save(str(tmp_path / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
        foreign = tmp_path / "step_9"  # named like ours: a name is no proof
        foreign.mkdir()
        (foreign / "manifest.json").write_bytes(_FOREIGN[kind])
        (foreign / "data.bin").write_bytes(b"not ours")
        with pytest.raises(ForeignManifestError) as raised:
            m.load(str(foreign))
        assert not isinstance(raised.value, CorruptCheckpointError), raised.value
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step_2"

    code, out = _cli("--json", "ls", str(tmp_path))
    doc = json.loads(out)
    assert code == 0 and doc["damaged"] == [] and doc["unreadable"] == [], doc
    assert [c["name"] for c in doc["checkpoints"]] == ["step_1", "step_2"], doc
    assert _cli("--json", "verify", str(foreign))[0] == 2  # could not check: no FAILED (exit 1)

    assert _cli("--json", "prune", str(tmp_path), "--keep-last", "1")[0] == 0
    assert _cli("--json", "gc", str(tmp_path))[0] == 0
    assert sorted(p.name for p in foreign.iterdir()) == ["data.bin", "manifest.json"]
    assert (foreign / "manifest.json").read_bytes() == _FOREIGN[kind]


@pytest.mark.parametrize("keep", [0, 40, 200], ids=["empty", "first-field", "into-items"])
def test_a_manifest_of_ours_cut_short_is_still_damaged(tmp_path: Path, keep: int) -> None:
    """The other side of the rule: bytes that name our fields are ours, and damage stays damage. An empty manifest
    too: a file left empty by a crash (a filesystem that kept the rename but not the bytes) is the commonest damage
    of all, and as another tool's it dropped out of `latest` with a DEBUG line."""
    with _manager() as m:
        m.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(4)}})
        manifest = tmp_path / "step_1" / "manifest.json"
        manifest.write_bytes(manifest.read_bytes()[:keep])
        with pytest.raises(CorruptCheckpointError):
            m.load(str(tmp_path / "step_1"))
    code, out = _cli("--json", "ls", str(tmp_path))
    assert code == 0 and [d["name"] for d in json.loads(out)["damaged"]] == ["step_1"], out
    assert _cli("--json", "verify", str(tmp_path / "step_1"))[0] == 1


def test_a_changed_kind_in_a_manifest_of_ours_is_damage(tmp_path: Path) -> None:
    """Defect: one changed byte in 'kind' ("torch_checkpointinf") made our newest checkpoint another tool's folder:
    `latest_checkpoint` went back to step_1 with a DEBUG line, `ls --json` listed no damage, `verify` exited 2."""
    with _manager() as m:
        for step in (1, 2):
            m.save(str(tmp_path / f"step_{step}"), {"model": {"w": torch.full((4,), float(step))}})
        manifest = tmp_path / "step_2" / "manifest.json"
        doc = json.loads(manifest.read_bytes())
        doc["kind"] = doc["kind"][:-1] + chr(ord(doc["kind"][-1]) ^ 1)
        manifest.write_text(json.dumps(doc))
        with pytest.raises(CorruptCheckpointError, match="'kind'"):
            m.load(str(tmp_path / "step_2"))
    code, out = _cli("--json", "ls", str(tmp_path))
    assert code == 0 and [d["name"] for d in json.loads(out)["damaged"]] == ["step_2"], out
    assert _cli("--json", "verify", str(tmp_path / "step_2"))[0] == 1
