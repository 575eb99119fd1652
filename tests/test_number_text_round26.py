"""Numbers read from text, and names matched by their digits: ASCII digits only, and a value of another type is a
`ConfigTypeError` naming the argument.

Python's `\\d` and `int()`/`float()` take any Unicode decimal digit (a full-width 5, an Arabic-Indic 5) and `int()`
takes `"1_0"` as 10: a size, a count or an age typed with them was read as a number nobody wrote, and a name
matched by `\\d` (an export's shard name in full-width digits) was taken for one the engine writes, and removed as
an earlier export's. `max_shard_size=True` was a shard size of one byte, and a float a bare TypeError.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from benchmarks.cli import parse_size as bench_size
from torch_checkpointing import CheckpointManager
from torch_checkpointing.cli import main
from torch_checkpointing.config import SyncCheckpointSaverConfig
from torch_checkpointing.errors import ConfigError, ConfigTypeError
from torch_checkpointing.hf import export_hf, parse_size

FULL_WIDTH_FIVE, ARABIC_INDIC_FIVE = "\uff15", "\u0665"


@pytest.mark.parametrize("value", [True, False, 1.5, 2.0, None, b"5GB"])
def test_a_shard_size_of_another_type_is_a_type_error_naming_it(value: object) -> None:
    with pytest.raises(ConfigTypeError, match="max_shard_size"):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", [f"{FULL_WIDTH_FIVE}GB", f"{ARABIC_INDIC_FIVE}MB", "1_000", "5\u00a0GB"])
def test_a_shard_size_in_other_digits_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="max_shard_size"):
        parse_size(text)


@pytest.mark.parametrize(
    "args",
    [
        ["prune", "{root}", "--keep-last", FULL_WIDTH_FIVE],
        ["prune", "{root}", "--keep-last", "1_0"],
        ["prune", "{root}", "--keep-best", f"1{ARABIC_INDIC_FIVE}", "--metric", "loss"],
        ["prune", "{root}", "--keep-every-n-steps", " 5"],
        ["gc", "{root}", "--older-than", FULL_WIDTH_FIVE],
        ["gc", "{root}", "--older-than", "1_000"],
        ["export", "{root}", "model", "{root}/out", "--rank", FULL_WIDTH_FIVE],
    ],
)
def test_a_command_line_number_in_other_digits_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(root=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "usage:" in err and args[-2] in err, err  # refused as it is read


def test_the_plain_spellings_still_read() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size(" 1.5 MiB ") == int(1.5 * 2**20) and parse_size(7) == 7
    assert bench_size("64MiB") == 64 << 20 and bench_size("1G") == 1 << 30


@pytest.mark.parametrize("text", [f"{FULL_WIDTH_FIVE}G", "inf", "0", "1_0M"])
def test_a_benchmark_size_is_a_positive_number_in_ascii_digits(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="digits 0-9"):
        bench_size(text)


def test_export_overwrite_leaves_a_file_named_like_a_shard_in_other_digits(tmp_path: Path) -> None:
    with CheckpointManager(CheckpointManager.Config(save=SyncCheckpointSaverConfig())) as manager:
        manager.save(str(tmp_path / "step_1"), {"model": {"w": torch.ones(4)}})
    out = tmp_path / "out"
    export_hf(tmp_path / "step_1", "model", out)
    mine = out / "model-\uff10\uff10\uff10\uff10\uff11-of-\uff10\uff10\uff10\uff10\uff12.safetensors"
    mine.write_bytes(b"the user's file")
    export_hf(tmp_path / "step_1", "model", out, overwrite=True)
    assert mine.read_bytes() == b"the user's file"
