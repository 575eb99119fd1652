"""The CLI's operations (`ls`, `inspect`, `prune`, `diff`, `gc`, `export`) as an operator runs them, through the
real command (`python -m torch_checkpointing`).

Before: `--json` wrote a NaN or infinite metric (a diverged loss, which `save(metrics=...)` takes and the manifest
records as the string "NaN") as the bare tokens `NaN` and `Infinity`, which are not JSON: `jq` and every strict
parser refused the whole document.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_checkpointing import CheckpointManager
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.manifest import MANIFEST_FILE_NAME
from torch_checkpointing.names import aside_name, host_tag, new_nonce

REPO = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300  # a loaded 2-core machine takes ~15 s to import torch


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("round28") / "run"
    metrics = [{"loss": float("nan"), "acc": float("inf")}, {"loss": 1.0, "acc": float("-inf")}]
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        for step, recorded in enumerate(metrics, 1):
            manager.save(str(run / f"step_{step}"), {"model": {"w": torch.ones(4)}}, step=step, metrics=recorded)
    return run


def _cli(*args: str, expect: int = 0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "torch_checkpointing", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "LC_ALL": "C.UTF-8"},
    )
    assert done.returncode == expect, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _strict(text: str) -> Any:
    """Parse as a strict JSON parser (jq, JavaScript's JSON.parse) does: no NaN/Infinity tokens."""

    def refuse(token: str) -> None:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    "argv",
    [["ls", "{root}"], ["inspect", "{root}/step_1"], ["prune", "{root}", "--keep-last", "1", "--dry-run"]],
    ids=["ls", "inspect", "prune"],
)
def test_json_output_writes_non_finite_metrics_as_the_manifest_does(root: Path, argv: list[str]) -> None:
    """Failed before: "ValueError: Infinity is not JSON" for each (`"acc": Infinity, "loss": NaN` on stdout)."""
    doc = _strict(_cli("--json", *(a.format(root=root) for a in argv)).stdout)
    found = json.dumps(doc)
    assert '"loss": "NaN"' in found and '"acc": "Infinity"' in found, found


_DIFF_UNDER_LIMITS = """
import contextlib, io, resource, sys, torch
from torch_checkpointing import CheckpointManager, ItemSpec, cli
from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
from torch_checkpointing.config import SyncCheckpointSaverConfig
root = sys.argv[1]
items = {"st": ItemSpec(layout=LayoutInfo("st_{rank}.safetensors", SafetensorsSerialization()))}
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig(), items=items)) as m:
    for name, fill in (("a", 1.0), ("b", 2.0)):
        values = torch.full((24 << 20,), fill)
        m.save(f"{root}/{name}", {"st": {"w": values}, "t": {"x": values.clone()}})

def run(argv):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            return str(cli.main(argv)), err.getvalue()
        except BaseException as exc:  # what the interpreter would print as a traceback, exiting 1
            return f"uncaught-{type(exc).__name__}", repr(exc)

argv = ["diff", f"{root}/a", f"{root}/b"]
assert run(argv)[0] == "1", run(argv)  # every import diff needs, with memory to spare; the two differ
base = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
for room in range(0, 577, 48):  # MiB of address space beyond what the process holds
    resource.setrlimit(resource.RLIMIT_AS, (base + room * 2**20, resource.RLIM_INFINITY))
    try:
        code, said = run(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(room, code, repr(said.strip()[:2000]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
def test_diff_out_of_memory_names_the_file_and_says_it_is_not_damage(tmp_path: Path) -> None:
    """Every run of `diff` under a memory limit ends 1 (the answer) or 2 naming a file of either checkpoint and
    saying the checkpoint was not found damaged.

    Failed before: "0 2 'torch-checkpointing diff: error: [Errno 12] Cannot allocate memory'" (the CRC32 check's
    map of a file), "256 2 '... error: unable to mmap 100663376 bytes from file </proc/self/fd/4>: Cannot allocate
    memory (12)'" (a safetensors item) and "384 2 '... DefaultCPUAllocator: can't allocate memory ...'" (the
    comparison): no file named, nothing said of damage."""
    done = subprocess.run(
        [sys.executable, "-c", _DIFF_UNDER_LIMITS, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S * 2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    short = [line for line in lines if line.split()[1] == "2"]
    assert short, f"no limit was low enough to show anything: {lines}"
    wrong = [line for line in lines if line.split()[1] not in ("1", "2")]
    wrong += [line for line in short if "not found damaged" not in line or str(tmp_path) not in line]
    assert not wrong, "\n".join(wrong)


NOBODY = 65534

_GC_AS_NOBODY = """
import os, sys
from torch_checkpointing import cli
cli.main(["--plain", "ls", sys.argv[1]])  # imports what the commands import, while root can
import encodings.ascii  # what gc's trash names read the boot id with
os.setgid(%(nobody)d)
os.setuid(%(nobody)d)
sys.exit(cli.main(["--plain", "gc", "--older-than", "0", sys.argv[1]]))
"""


@pytest.fixture
def copies_aside() -> Iterator[tuple[Path, Path, Path]]:
    """A root another user may change, holding nothing at the id `ckpt` and two copies a dead writer's replaces
    moved aside: the older one readable, the newer one's manifest closed to that user. Yields (root, older,
    newer)."""
    base = Path(tempfile.mkdtemp(prefix="round28-asides-"))
    try:
        os.chmod(base, 0o755)
        root = base / "run"
        with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
            for step in (1, 2):
                manager.save(str(root / f"step_{step}"), {"model": {"w": torch.full((2,), float(step))}}, step=step)
        dead = subprocess.Popen(["true"])
        dead.wait()
        older, newer = (root / aside_name("ckpt", dead.pid, new_nonce(), host_tag()) for _ in range(2))
        (root / "step_1").rename(older)
        (root / "step_2").rename(newer)
        for folder, _, files in os.walk(root):
            for path in [folder, *(os.path.join(folder, f) for f in files)]:
                os.chown(path, NOBODY, NOBODY)
        os.chown(newer / MANIFEST_FILE_NAME, 0, 0)
        os.chmod(newer / MANIFEST_FILE_NAME, 0o600)
        yield root, older, newer
    finally:
        shutil.rmtree(base)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="drops to another user: needs root")
def test_gc_never_removes_a_copy_aside_it_may_not_read(copies_aside: tuple[Path, Path, Path]) -> None:
    """Which copy was committed last cannot be told when one of them cannot be read: nothing is put back, nothing
    removed, and the log says why.

    Failed before: gc read the closed copy as "not whole", moved the older copy back under `ckpt` and removed the
    newer one ("removed 1 leftover(s)"; `ckpt` then held step 1, and step 2 was gone)."""
    root, older, newer = copies_aside
    done = subprocess.run(
        [sys.executable, "-c", _GC_AS_NOBODY % {"nobody": NOBODY}, str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert newer.is_dir() and older.is_dir(), said
    assert not (root / "ckpt").exists(), said
    assert "may not read" in done.stderr and newer.name in done.stderr, said


def test_gc_never_removes_a_copy_aside_a_newer_engine_wrote(copies_aside: tuple[Path, Path, Path]) -> None:
    """The same for a copy whose manifest a newer engine wrote (a higher `manifest_version` and
    `library_version`): not ours to judge.

    Failed before: the older copy was moved back under `ckpt` and the newer engine's copy removed."""
    root, older, newer = copies_aside
    os.chmod(newer / MANIFEST_FILE_NAME, 0o644)
    manifest = json.loads((newer / MANIFEST_FILE_NAME).read_text())
    (newer / MANIFEST_FILE_NAME).write_text(json.dumps({**manifest, "manifest_version": 99, "library_version": "99.0"}))
    done = _cli("gc", "--older-than", "0", str(root))
    said = done.stdout + done.stderr
    assert newer.is_dir() and older.is_dir(), said
    assert not (root / "ckpt").exists(), said
    assert "newer engine" in done.stderr and newer.name in done.stderr, said


_UNDER_LIMITS = """
import contextlib, io, json, os, resource, shutil, sys, torch
from torch_checkpointing import CheckpointManager, cli
from torch_checkpointing.config import SyncCheckpointSaverConfig
work, which, limit = sys.argv[1:4]
template = f"{work}/template"
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    for s in range(1, 5):
        m.save(f"{template}/step_{s}", {"model": {f"w{i}": torch.full((1 << 20,), float(s)) for i in range(4)}}, step=s)
os.makedirs(f"{template}/.step_9.tmp-0123456789ab-1")  # a dead save's temporary: gc removes it
open(f"{template}/.step_9.tmp-0123456789ab-1/.incomplete", "w").close()
argv = {
    "prune": ["prune", f"{work}/root", "--keep-last", "1"],
    "gc": ["gc", "--older-than", "0", f"{work}/root"],
    "export": ["export", "--item", "model", "--to", "hf", "--max-shard-size", "8MB", f"{work}/root/step_4",
               f"{work}/out"],
}[which]

def tree():
    found = (os.path.relpath(os.path.join(d, n), work) for d, ds, fs in os.walk(work) for n in ds + fs)
    return sorted(p for p in found if p.split("/")[0] != "template")

def fresh():
    shutil.rmtree(f"{work}/root", ignore_errors=True)
    shutil.rmtree(f"{work}/out", ignore_errors=True)
    shutil.copytree(template, f"{work}/root")

def run():
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            return str(cli.main(argv)), err.getvalue().strip()
        except BaseException as exc:  # what the interpreter would print as a traceback, exiting 1
            return f"uncaught-{type(exc).__name__}", repr(exc)

fresh()
assert run()[0] == "0"
print("BASELINE", json.dumps(tree()), sep="\t")
kind = resource.RLIMIT_AS if limit == "as" else resource.RLIMIT_NOFILE
for room in (range(0, 129, 32) if limit == "as" else range(0, 4)):
    fresh()
    if limit == "as":  # MiB of address space beyond what the process holds
        value = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize() + room * 2**20
    else:  # descriptors left: the lowest free one is the first a new open takes
        probe = os.open(os.devnull, os.O_RDONLY)
        os.close(probe)
        value = probe + room
    before = resource.getrlimit(kind)
    resource.setrlimit(kind, (value, before[1]))
    try:
        code, said = run()
    finally:
        resource.setrlimit(kind, before)
    print("RUN", room, code, json.dumps(tree()), repr(said[-600:]), sep="\t")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/statm are Linux's")
@pytest.mark.parametrize("limit", ["nofile", "as"])
@pytest.mark.parametrize("command", ["prune", "gc", "export"])
def test_a_command_short_of_descriptors_or_memory_does_all_or_says_so(tmp_path: Path, command: str, limit: str) -> None:
    """Under a stepped RLIMIT_NOFILE or RLIMIT_AS, each run of `prune`, `gc` and `export` either leaves exactly what
    a run with room leaves (exit 0), or exits 2 saying that nothing was found damaged, and leaves no temporaries.

    Failed before: with no descriptor left, gc exited 0 keeping the dead save's temporary as one that "holds no
    manifest.json or .incomplete of ours" (the marker's read took a second descriptor, a dup); prune said a bare
    "[Errno 24] Too many open files"; and export under RLIMIT_AS called the intact checkpoint file "not a
    readable Torch file ...: can't start new thread"."""
    done = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMITS, str(tmp_path), command, limit],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    baseline = next(line.split("\t")[1] for line in lines if line.startswith("BASELINE\t"))
    runs = [line.split("\t")[1:] for line in lines if line.startswith("RUN\t")]
    wrong = [r for r in runs if r[1] == "0" and r[2] != baseline]
    wrong += [r for r in runs if r[1] not in ("0", "2")]
    wrong += [r for r in runs if r[1] == "2" and "not found damaged" not in r[3]]
    wrong += [r for r in runs if any("/." in f"/{p}" for p in json.loads(r[2]) if ".step_9" not in p)]
    assert not wrong, f"baseline {baseline}\n" + "\n".join(map(str, wrong))


_IMPORT_UNDER_LIMITS = """
import os, resource, sys, torch
from torch_checkpointing import CheckpointManager, cli
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.hf import import_hf
work = sys.argv[1]
with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as m:
    m.save(f"{work}/ck", {"model": {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(4)}})
argv = ["--plain", "export", "--item", "model", "--to", "hf", "--max-shard-size", "2MB", f"{work}/ck", f"{work}/hf"]
assert cli.main(argv) == 0
assert sorted(import_hf(f"{work}/hf")) == [f"w{i}" for i in range(4)]
for room in range(0, 4):  # descriptors left: the lowest free one is the first a new open takes
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe + room, before[1]))
    try:
        said = "imported %d" % len(import_hf(f"{work}/hf"))
    except Exception as exc:
        said = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)
    print("RUN", room, said.replace(chr(10), " "), sep="\\t")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_NOFILE's lowest-free rule is POSIX's")
def test_import_hf_short_of_descriptors_names_the_file(tmp_path: Path) -> None:
    """Each `import_hf` under a stepped RLIMIT_NOFILE imports every tensor or raises an `OSError` naming the file
    it was opening and saying it was not found damaged.

    Failed before: "OSError: [Errno 24] Too many open files: '.../model.safetensors.index.json'" (the open of the
    index) and "OSError: [Errno 24] Too many open files" (the in-memory copy of a shard), naming neither the
    shortage as one nor, for the copy, any file."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_UNDER_LIMITS, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = [line.split("\t")[1:] for line in done.stdout.splitlines() if line.startswith("RUN\t")]
    assert any(said != "imported 4" for _, said in runs), runs
    failed = [r for r in runs if r[1] != "imported 4"]
    wrong = [r for r in failed if not r[1].startswith("OSError: ") or "not found damaged" not in r[1]]
    wrong += [r for r in failed if str(tmp_path / "hf") not in r[1]]
    assert not wrong, "\n".join(map(str, wrong))
