"""Command line: ``python -m benchmarks [--quick] [--size 1G] ...``."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from .config import ALL_SECTIONS, SCALE_ALONE_TIMEOUT_S, BenchConfig, GiB, MiB
from .report import compute_ratios, format_table, markdown_section, summary, to_json
from .runner import run_all
from .sysinfo import machine


def parse_size(text: str) -> int:
    """'512M', '1G', '64MiB' or a plain byte count: a positive, finite size in the digits 0-9."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in "KMG" else t
    try:
        if not num.isascii() or "_" in num:  # float() takes a full-width 5 and 1_0 as 10
            raise ValueError(num)
        number = float(num)
        if not math.isfinite(number) or number * mult < 1:
            raise ValueError(num)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a positive number in the digits 0-9 with an optional K/M/G suffix"
        ) from None
    return int(number * mult)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: every section, the same measurements on less data (64 MiB state, 2 and 4 ranks, scale on "
        "128 <-> 256 ranks); several minutes on 2 busy cores (its scale section alone: under a minute)",
    )
    p.add_argument("--size", type=parse_size, help="synthetic state size, e.g. 256M, 1G (default 1G)")
    p.add_argument("--runs", type=int, help="runs per measurement; the targets use the median (default 5)")
    p.add_argument("--memory-saves", type=int, help="consecutive saves for the memory-growth check (default 20)")
    p.add_argument("--sections", nargs="+", choices=ALL_SECTIONS, help="run only these sections")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where the state lives (auto: cuda when available)",
    )
    p.add_argument("--no-direct-io", action="store_true", help="LocalFileSystemStorageConfig(use_direct_io=False)")
    p.add_argument(
        "--workdir",
        type=Path,
        help="parent of the temporary benchmark directory (default ./bench-out; must be a real disk, not tmpfs)",
    )
    p.add_argument("--out", type=Path, help="JSON results path (default ./bench-out/results.json)")
    p.add_argument(
        "--timeout",
        type=float,
        help=f"per-section timeout in seconds (default {BenchConfig().section_timeout_s:.0f}; --quick "
        f"{BenchConfig.quick_config().section_timeout_s:.0f}; the scale section alone {SCALE_ALONE_TIMEOUT_S:.0f})",
    )
    p.add_argument(
        "--sweep",
        nargs="*",
        type=parse_size,
        metavar="SIZE",
        help="instead of the full run: blocked time and time to durable vs state size "
        "(default sizes 256M 512M 1G 2G 4G) plus the plot",
    )
    p.add_argument(
        "--markdown",
        type=Path,
        metavar="JSON",
        help="print the docs/performance.md section of an earlier run's JSON and exit",
    )
    p.add_argument("--plot", type=Path, default=Path("docs/performance.png"), help="plot path for --sweep")
    p.add_argument(
        "--scale",
        action="store_true",
        help="only the scale section: metadata and resharding plans of a 70B layout on 1024/2048 "
        "ranks, computed without launching ranks (same as --sections scale); one process of pure computation, "
        "about 4 CPU-minutes of one core, so on a loaded machine the wall time is longer (12 min at load 10 "
        "on 2 cores)",
    )
    p.add_argument(
        "--scale-dp",
        type=int,
        help="scale section: data-parallel size of the saving mesh (x8 TP; "
        "default 128, i.e. 1024 ranks, loaded on 2048 and back)",
    )
    p.add_argument("--scale-layers", type=int, help="scale section: transformer layers (default 80: 70B params)")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    over: dict[str, Any] = {}
    if args.size is not None:
        over["size_bytes"] = args.size
    if args.runs is not None:
        over["runs"] = args.runs
    if args.memory_saves is not None:
        over["memory_saves"] = args.memory_saves
    if args.sections:
        over["sections"] = tuple(args.sections)
    if args.scale:
        over["sections"] = ("scale",)
    if args.scale_dp is not None:
        over["scale_dp"] = args.scale_dp
    if args.scale_layers is not None:
        over["scale_layers"] = args.scale_layers
    if args.workdir is not None:
        over["work_parent"] = args.workdir
    if args.out is not None:
        over["out_json"] = args.out
    if args.timeout is not None:
        over["section_timeout_s"] = args.timeout
    elif over.get("sections") == ("scale",) and not args.quick:
        over["section_timeout_s"] = SCALE_ALONE_TIMEOUT_S
    over["device"] = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    over["direct_io"] = not args.no_direct_io
    return BenchConfig.quick_config(**over) if args.quick else replace(BenchConfig(), **over)


def run(cfg: BenchConfig, command: str, log: Any = print) -> dict[str, Any]:
    """The full benchmark: sections, ratio table, JSON. Returns the JSON document."""
    t0 = time.perf_counter()
    results = run_all(cfg, log)
    rows = compute_ratios(results)
    meta = {
        "command": command,
        "machine": machine(),
        "wall_s": time.perf_counter() - t0,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
    }
    doc = to_json(results, rows, meta, cfg.out_json)
    log("")
    log(format_table(rows))
    s = summary(rows)
    log(
        f"\n{s['passed']}/{s['targets']} targets pass; failed: {s['failed'] or 'none'}; "
        f"errors: {s['errors'] or 'none'}; wall {meta['wall_s']:.0f}s; JSON: {cfg.out_json}"
    )
    return doc


def _check_writable(parser: argparse.ArgumentParser, flag: str, folder: Path) -> None:
    """Refuse, before any section runs, a folder nothing can be written in: the results were lost to a traceback
    at the end of the run, a quarter of an hour later for the full one."""
    try:
        folder.mkdir(parents=True, exist_ok=True)  # the run makes it too
        os.rmdir(tempfile.mkdtemp(prefix=".benchmarks-probe-", dir=folder))
    except OSError as exc:
        parser.error(f"{flag} {str(folder)!r}: nothing can be written there ({exc}); name a writable directory")


def _check_file(parser: argparse.ArgumentParser, flag: str, path: Path) -> None:
    """Refuse, before any section runs, an existing `path` the run writes at its end: a directory, or a file
    that cannot be opened for writing (set immutable, read-only to this user). Its folder's probe passed them,
    and the write failed in a traceback after every section had run. Opened without truncating it, and without
    waiting on a FIFO."""
    if path.is_dir():
        parser.error(f"{flag} {str(path)!r}: is a directory; name a file to write")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except FileNotFoundError:
        return
    except OSError as exc:
        parser.error(f"{flag} {str(path)!r}: exists and cannot be written ({exc.strerror or exc})")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.markdown is not None:
        print(markdown_section(json.loads(args.markdown.read_text())))
        return 0
    cfg = config_from_args(args)
    _check_writable(parser, "--workdir", cfg.work_parent)
    _check_writable(parser, "--out", cfg.out_json.parent)
    _check_file(parser, "--out", cfg.out_json if args.sweep is None else cfg.out_json.with_name("sweep.json"))
    if args.sweep is not None and args.plot is not None:
        _check_writable(parser, "--plot", args.plot.parent)
        _check_file(parser, "--plot", args.plot)
    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    if args.sweep is not None:
        from .sweep import run_sweep

        sizes = args.sweep or [256 * MiB, 512 * MiB, GiB, 2 * GiB, 4 * GiB]
        run_sweep(cfg, sizes, args.plot, command.strip())
        return 0
    doc = run(cfg, command.strip())
    # Failed targets are findings, not a broken run; a ratio that could not be
    # measured at all (a section crashed) is.
    return 1 if doc["summary"]["errors"] else 0
