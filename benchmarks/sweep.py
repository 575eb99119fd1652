"""Blocked time and time to durable vs state size, for us and each baseline,
and the plot of it (docs/performance.png)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from .config import BenchConfig
from .runner import run_all
from .sysinfo import machine, median

# (series label, section, result key)
BLOCKED = [
    ("ours", "engine", "blocked_s"),
    ("dcp.async_save", "dcp", "async_blocked_s"),
    ("memory-copy floor", "engine", "memcpy_s"),
]
DURABLE = [
    ("ours", "engine", "durable_s"),
    ("raw write+fsync floor", "engine", "raw_write_s"),
    ("torch.save+fsync", "torch_save", "save_durable_s"),
    ("dcp.save", "dcp", "save_s"),
    ("dcp.async_save", "dcp", "async_durable_s"),
]


def _series(points: list[dict[str, Any]], spec: list[tuple[str, str, str]]) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {}
    for label, section, key in spec:
        vals: list[float | None] = []
        for p in points:
            res = p["results"].get(section, {}).get("result", {})
            vals.append(median(res[key]) if res.get(key) else None)
        out[label] = vals
    return out


def plot(doc: dict[str, Any], path: Path) -> str:
    """Write the PNG; returns a message. Never raises for a missing matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            "plot skipped: matplotlib is not installed "
            "(pip install matplotlib, or the project's optional 'bench' extra)"
        )
    sizes = [s / 2**20 for s in doc["sizes"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (title, series) in zip(
        axes, (("blocked time per async save", doc["blocked"]), ("time to durable", doc["durable"])), strict=False
    ):
        for label, vals in series.items():
            pts = [(x, y) for x, y in zip(sizes, vals, strict=False) if y is not None]
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    label=label,
                    linewidth=2.5 if label == "ours" else 1.2,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("state size (MiB)")
        ax.set_ylabel("seconds (median)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{doc['machine']['cpu']}, {doc['machine']['cores']} cores", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot written to {path}"


def run_sweep(cfg: BenchConfig, sizes: list[int], plot_path: Path, command: str, log: Any = print) -> dict[str, Any]:
    points = []
    for size in sizes:
        c = replace(
            cfg,
            size_bytes=size,
            runs=min(cfg.runs, 3),
            memory_saves=min(cfg.runs, 3) + 1,
            saves_only=True,
            sections=("engine", "dcp", "torch_save"),
        )
        log(f"[sweep] {size / 2**20:.0f} MiB")
        points.append({"size": size, "results": run_all(c, log)})
    doc: dict[str, Any] = {
        "command": command,
        "machine": machine(),
        "sizes": sizes,
        "blocked": _series(points, BLOCKED),
        "durable": _series(points, DURABLE),
        "points": points,
    }
    out = cfg.out_json.with_name("sweep.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    log(f"[sweep] JSON: {out}")
    for title, key in (("blocked (s)", "blocked"), ("durable (s)", "durable")):
        log(f"\n{title:<24}" + "".join(f"{s / 2**20:>10.0f}M" for s in sizes))
        for label, vals in doc[key].items():
            log(f"{label:<24}" + "".join(f"{v:>11.3f}" if v is not None else f"{'n/a':>11}" for v in vals))
    log(plot(doc, plot_path))
    return doc
