"""Benchmark helpers whose type findings were real defects: each refuses what it cannot do by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.config import BenchConfig


def test_overlap_staging_with_a_sync_save_is_refused_by_name(tmp_path: Path) -> None:
    """A sync save has no staging to overlap: the pair is refused naming both arguments, not an AttributeError
    from the sync saver's config (which has no staging_config)."""
    from benchmarks.engine_api import make_manager

    with pytest.raises(ValueError, match=r"overlap_staging=True.*sync_save=True"):
        make_manager(BenchConfig(work_parent=tmp_path), sync_save=True, overlap_staging=True)
