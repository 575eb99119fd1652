"""Round 27: a launch whose args cannot be pickled left its directory of rank logs behind.

`launch()` hands the ranks fn and args through a file of the launch's directory (`_hand_over`), written before
the launch's clean-up was armed: args that cannot be pickled (a lock, an open file) raised out of `launch()` and
left `<name>-ranks-*` in the temporary directory, once per call. Before the hand-over file, the same args failed
inside the spawn, under the clean-up.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path

import pytest

from simulator.launcher import launch


def test_a_launch_whose_args_cannot_be_pickled_leaves_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: TypeError raised, and tmp_path held ['hand-over-ranks-...'].
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TypeError, match="pickle"):
        launch(os.getpid, 2, args=(threading.Lock(),), timeout=30, name="hand-over")
    assert os.listdir(tmp_path) == []
