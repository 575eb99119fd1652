"""`gc --older-than` takes seconds; an age written with a unit is refused naming the unit and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_checkpointing.cli import main


@pytest.mark.parametrize("text", ["1.5h", "3d", "1h30m", "0x10"])
def test_an_older_than_with_a_unit_names_seconds_and_how_to_write_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """`gc --older-than 1.5h` said only "could not convert string to float: '1.5h'"."""
    with pytest.raises(SystemExit) as exit_info:
        main(["gc", str(tmp_path), "--older-than", text])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and repr(text) in err, err
    assert "number of seconds" in err and "86400 for a day" in err, err
