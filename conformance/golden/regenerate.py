"""Regenerate the golden checkpoints with the backend in this environment.

    python -m conformance.golden.regenerate --writer ours
    CONFORMANCE_PREFER_INSTALLED=1 python -m conformance.golden.regenerate --writer upstream --single-rank-only

Writes ``conformance/golden/<writer>/<case>/`` for every single-rank case and, unless
``--single-rank-only``, the 2-rank DTensor case through the simulator's launcher.
Values are seeded (see cases.py): regenerating with an unchanged backend gives
checkpoints that load to the same bits.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from conformance import backend

_REPO_ROOT = Path(__file__).resolve().parents[2]


def _write_single(dest: Path) -> None:
    from conformance.golden.cases import CASES
    from conformance.helpers import make_config, save

    manager_cls = backend.name("", "CheckpointManager")
    for case in CASES:
        manager = manager_cls(make_config(case.items()))
        try:
            save(manager, dest / case.name, case.payload())
        finally:
            manager.close()


def _write_dtensor(dest: Path) -> None:
    from conformance import rank_programs
    from conformance.golden.cases import DTENSOR_CASE
    from simulator.launcher import launch

    launch(rank_programs.write_golden_dtensor, 2, args=(str(dest / DTENSOR_CASE),), timeout=240.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writer", required=True, help="folder name under conformance/golden/ (e.g. ours, upstream)")
    parser.add_argument("--single-rank-only", action="store_true", help="skip the 2-rank DTensor checkpoint")
    args = parser.parse_args(argv)
    if backend.prefer_installed_requested():
        backend.prefer_installed_backend(_REPO_ROOT)
    out = Path(__file__).resolve().parent / args.writer
    with tempfile.TemporaryDirectory(prefix="golden-") as tmp:
        staging = Path(tmp) / args.writer
        _write_single(staging)
        if not args.single_rank_only:
            _write_dtensor(staging)
        root = backend.module()
        (staging / "WRITER.txt").write_text(f"{root.__name__} {getattr(root, '__version__', 'unknown')}\n")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staging, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
