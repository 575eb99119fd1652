"""Turns raw section results into the ratio table (target, pass/fail) and JSON.

Each ratio divides one of our medians by a baseline median measured in the same
run on the same bytes. A ratio whose inputs are missing (a section failed) is
still listed, with the error, so a report always names every target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .sysinfo import median


@dataclass
class Ratio:
    """One row of the verdict table."""

    key: str
    label: str
    value: float | None = None
    op: str = "<="  # "<=", "<" or "info"
    limit: float | None = None
    unit: str = "x"
    detail: str = ""
    error: str | None = None
    skipped: str | None = None  # why a row cannot be measured on this machine (e.g. no CUDA device)

    @property
    def passed(self) -> bool | None:
        if self.value is None or self.op == "info" or self.limit is None:
            return None
        return self.value <= self.limit if self.op == "<=" else self.value < self.limit

    @property
    def target(self) -> str:
        return "info" if self.op == "info" else f"{self.op} {self.limit:g}{self.unit}"


class NotMeasured(Exception):
    """A row this machine cannot measure (no CUDA device): listed as "not measured", neither error nor verdict."""


Results = dict[str, dict[str, Any]]
Getter = Callable[[Results], tuple[float, str]]


def _r(results: Results, section: str) -> dict[str, Any]:
    sec = results.get(section)
    if sec is None:
        raise NotMeasured(f"section '{section}' was not run in this invocation (--sections / --scale)")
    if "result" not in sec:
        raise LookupError(f"section '{section}' failed: {sec.get('error')}")
    result = sec["result"]
    if not isinstance(result, dict):
        raise LookupError(f"section '{section}' recorded a {type(result).__name__} as its result, not a mapping")
    return result


def _m(results: Results, section: str, key: str) -> float:
    res = _r(results, section)
    if key not in res:
        raise LookupError(f"section '{section}' has no '{key}' (a --sweep run measures saves only)")
    val = res[key]
    return median(val) if isinstance(val, list) else float(val)


def _div(results: Results, num: tuple[str, str], den: tuple[str, str]) -> tuple[float, str]:
    a, b = _m(results, *num), _m(results, *den)
    return a / b, f"{num[0]}.{num[1]} {a * 1e3:.1f} ms / {den[0]}.{den[1]} {b * 1e3:.1f} ms"


def _no_copy_ms(results: Results) -> tuple[float, str]:
    v = _m(results, "engine", "no_copy_blocked_s") * 1e3
    return v, f"all items requires_copy=False, median {v:.3f} ms"


def _loop_wait(results: Results) -> tuple[float, str]:
    lp = _r(results, "loop")
    w, s = median(lp["save_lock_wait_s"]), median(lp["plain_step_s"])
    pre = "holds" if lp["forward_backward_s"] > lp["copy_s"] else "DOES NOT hold"
    return w / s, (
        f"lock wait {w * 1e3:.2f} ms / step {s * 1e3:.1f} ms; precondition fwd+bwd "
        f"{lp['forward_backward_s'] * 1e3:.0f} ms > copy {lp['copy_s'] * 1e3:.0f} ms {pre}"
    )


def _loop_step(results: Results) -> tuple[float, str]:
    lp = _r(results, "loop")
    a, b = median(lp["inflight_step_s"]), median(lp["plain_step_s"])
    return a / b, f"step with save in flight {a * 1e3:.1f} ms / without {b * 1e3:.1f} ms"


def _reshard_rank_medians(results: Results, kind: str, temp: str, field: str) -> list[float]:
    ranks = _r(results, "reshard")["ranks"]
    return [median(r[kind][temp][i][field] for i in range(len(r[kind][temp]))) for r in ranks]


def _rank_read(r: dict[str, Any], kind: str) -> tuple[float, float]:
    """(rchar on warm loads, read_bytes on a cold load run alone) / needed; see reshard.py."""
    rchar = median(x["rchar"] for x in r[kind]["warm"]) / r["needed"]
    disk = r[kind]["alone"][r["rank"]]["read_bytes"] / r["needed"]
    return rchar, disk


def _reshard_bytes(results: Results) -> tuple[float, str]:
    ranks = _r(results, "reshard")["ranks"]
    per = [_rank_read(r, "reshard") for r in ranks]
    worst = max(range(len(per)), key=lambda i: max(per[i]))
    same = max(max(_rank_read(r, "same")) for r in ranks)
    return max(per[worst]), (
        f"worst rank {worst}: rchar(warm) {per[worst][0]:.2f}x, read_bytes(cold, alone) "
        f"{per[worst][1]:.2f}x needed; all ranks "
        + " ".join(f"{max(p):.2f}" for p in per)
        + f"; same-layout worst {same:.2f}x"
    )


def _reshard_time(results: Results) -> tuple[float, str]:
    ranks = _r(results, "reshard")["ranks"]
    reps = len(ranks[0]["reshard"]["warm"])
    re_ = median(max(r["reshard"]["warm"][i]["s"] for r in ranks) for i in range(reps))
    same = median(max(r["same"]["warm"][i]["s"] for r in ranks) for i in range(reps))
    return re_ / same, f"slowest rank, 4->8 {re_ * 1e3:.1f} ms / 8->8 {same * 1e3:.1f} ms"


def _reshard_time_cold(results: Results) -> tuple[float, str]:
    ranks = _r(results, "reshard")["ranks"]
    reps = len(ranks[0]["reshard"]["cold"])
    re_ = median(max(r["reshard"]["cold"][i]["s"] for r in ranks) for i in range(reps))
    same = median(max(r["same"]["cold"][i]["s"] for r in ranks) for i in range(reps))
    return re_ / same, f"page cache dropped: 4->8 {re_ * 1e3:.1f} ms / 8->8 {same * 1e3:.1f} ms"


def _reshard_disk(results: Results) -> tuple[float, str]:
    ranks = _r(results, "reshard")["ranks"]
    reps = len(ranks[0]["reshard"]["cold"])
    disk = median(sum(r["reshard"]["cold"][i]["read_bytes"] for r in ranks) for i in range(reps))
    need = sum(r["needed"] for r in ranks)
    return disk / need, f"all ranks, cold: block-layer reads {disk / 2**20:.1f} MiB / needed {need / 2**20:.1f} MiB"


def _rss_growth(results: Results) -> tuple[float, str]:
    rss = _r(results, "engine")["rss_after_save"]
    return rss[-1] / rss[1], f"RSS after {len(rss)} saves {rss[-1] / 2**20:.0f} MiB / after 2 {rss[1] / 2**20:.0f} MiB"


def _extra_rss(results: Results) -> tuple[float, str]:
    e = _r(results, "engine")
    extra = e["rss_after_save"][-1] - e["rss_before_first_save"]
    return extra / e["staged_bytes"], (
        f"extra resident {extra / 2**20:.0f} MiB / staged {e['staged_bytes'] / 2**20:.0f} MiB"
    )


def _writer_rss(results: Results) -> tuple[float, str]:
    e = _r(results, "engine")
    w = e["writer"].get("VmHWM", 0)
    return w / e["staged_bytes"], (
        f"writer peak RSS {w / 2**20:.0f} MiB, trainer peak "
        f"{e['trainer_peak_rss'] / 2**20:.0f} MiB, staged {e['staged_bytes'] / 2**20:.0f} MiB"
    )


def _cache_drop(results: Results) -> tuple[float, str]:
    c, w = _m(results, "engine", "raw_read_cold_s"), _m(results, "engine", "raw_read_warm_s")
    b = _r(results, "engine")["bytes"]
    return c / w, f"raw read cold {b / c / 1e9:.2f} GB/s vs warm {b / w / 1e9:.2f} GB/s (>1 means the drop works)"


def _dcp_copy(results: Results) -> tuple[float, str]:
    ok = _r(results, "dcp").get("async_stages_copy")
    if ok is None:
        raise LookupError("dcp section ran saves-only (--sweep)")
    return float(bool(ok)), "1 = dcp.async_save captured the state as of the call (a real staging copy)"


def _scale_plan(which: str) -> Getter:
    def get(results: Results) -> tuple[float, str]:
        sc = _r(results, "scale")[which]
        src, dst = sc["src"], sc["dst"]
        return sc["one_rank_s"], (
            f"{sc['tensors']} tensors, {src[0]}x{src[1]} -> {dst[0]}x{dst[1]} ranks: slowest of "
            f"{len(sc['ranks'])} sampled ranks {sc['one_rank_s']:.2f} s, all "
            f"{dst[0] * dst[1]} ranks planned one after another {sc['all_ranks_s']:.0f} s (one core; in a job each "
            f"rank plans only itself); "
            f"parse metadata.json {sc['parse_s']:.2f} s"
        )

    return get


def _scale_meta(results: Results) -> tuple[float, str]:
    sc = _r(results, "scale")
    sizes = {sc[w]["src"][0] * sc[w]["src"][1]: sc[w] for w in ("up", "down")}
    world = max(sizes)
    big = sizes[world]
    parts = ", ".join(
        f"{w} ranks {m['metadata_bytes'] / 2**20:.1f} MiB (serialise {m['serialise_s']:.1f} s)"
        for w, m in sorted(sizes.items())
    )
    return big["metadata_bytes"] / 2**20, (
        f"{sc['params'] / 1e9:.1f}B params, {big['tensors']} tensors: {parts}, version 2.0 would be "
        f"{big['metadata_bytes_v2'] / 2**20:.1f} MiB"
    )


def _scale_bytes(results: Results) -> tuple[float, str]:
    sc = _r(results, "scale")
    worst = max((sc[w]["all_ranks_worst_read_ratio"], w, sc[w]["all_ranks_worst_read_rank"]) for w in ("up", "down"))
    return worst[0], f"worst of all ranks ({worst[1]}, rank {worst[2]}), MADV_WILLNEED bounding ranges in pages"


def _scale_growth(results: Results) -> tuple[float, str]:
    sc = _r(results, "scale")
    pts = " ".join(f"{g['dst_world']}:{g['one_rank_s']:.3f}s" for g in sc["growth"])
    work = " ".join(f"{g['dst_world']}:{g['chunk_checks']}" for g in sc["growth"])
    return sc["growth_exponent_work"], (
        f"d log(planner work for one rank) / d log(world) (0 = flat, 1 = linear; all ranks add 1); chunk checks "
        f"per target rank by target world {work}; one-rank times {pts} (time exponent {sc['growth_exponent']:.2f})"
    )


def _engine_s(key: str, what: str) -> Getter:
    def get(results: Results) -> tuple[float, str]:
        v = _m(results, "engine", key)
        return v, f"{what} {v * 1e3:.1f} ms"

    return get


def _first_durable(results: Results) -> tuple[float, str]:
    e = _r(results, "engine")
    first, warm = float(e["durable_cold_s"]), median(e["durable_s"])
    return first / warm, (
        f"first save {first * 1e3:.0f} ms / warm {warm * 1e3:.0f} ms (first save right after "
        f"construction: the spawned writer's start-up overlaps it)"
    )


def _ranks(results: Results, world: int) -> list[dict[str, Any]]:
    ranks = _r(results, "ranks").get(str(world))
    if ranks is None:
        raise NotMeasured(f"the ranks section did not run {world} ranks (--quick runs 2 and 4 only)")
    return list(ranks)


def _ranks_first(world: int) -> Getter:
    def get(results: Results) -> tuple[float, str]:
        rs = _ranks(results, world)
        first = max(r["first_durable_s"] for r in rs)
        warm = median(max(r["durable_s"][i] for r in rs) for i in range(len(rs[0]["durable_s"])))
        ctor = max(r["ctor_s"] for r in rs)
        return first / warm, (
            f"slowest rank: first save {first * 1e3:.0f} ms / warm {warm * 1e3:.0f} ms; "
            f"construction {ctor * 1e3:.0f} ms"
        )

    return get


def _ranks_close(world: int) -> Getter:
    def get(results: Results) -> tuple[float, str]:
        rs = _ranks(results, world)
        close = [r["close_s"] for r in rs]
        return max(close), "per rank: " + " ".join(f"{c * 1e3:.0f}" for c in close) + " ms"

    return get


def _ranks_aggregate(world: int) -> Getter:
    def get(results: Results) -> tuple[float, str]:
        rs = _ranks(results, world)
        n = len(rs[0]["durable_s"])
        agg = median(max(r["durable_s"][i] for r in rs) for i in range(n))
        floor = median(rs[0]["floor_s"])
        total = rs[0]["total"]
        return agg / floor, (
            f"{world} ranks x {total / world / 2**20:.0f} MiB, slowest rank to durable "
            f"{agg * 1e3:.0f} ms / one process writing {total / 2**20:.0f} MiB {floor * 1e3:.0f} ms"
        )

    return get


def _writer_headroom(results: Results) -> tuple[float, str]:
    e = _r(results, "engine")
    w = e["writer"].get("VmHWM", 0)
    return (w - e["staged_bytes"]) / 2**20, (
        f"writer peak RSS {w / 2**20:.0f} MiB - staged "
        f"{e['staged_bytes'] / 2**20:.0f} MiB (the mapped slab counts in RSS)"
    )


def _cuda(results: Results) -> tuple[float, str]:
    e = _r(results, "engine")
    if e.get("device", "cpu") == "cpu":
        raise NotMeasured("no CUDA device on this machine (run with --device cuda where there is one)")
    return _div(results, ("engine", "blocked_s"), ("engine", "memcpy_s"))


def _cuda_first(results: Results) -> tuple[float, str]:
    _cuda(results)
    return _div(results, ("engine", "blocked_cold_s"), ("engine", "memcpy_s"))


def _s3(results: Results) -> dict[str, Any]:
    s3 = _r(results, "s3")
    if s3.get("not_measured"):
        raise NotMeasured(s3["not_measured"])
    return s3


def _s3_durable(results: Results) -> tuple[float, str]:
    s3 = _s3(results)
    a, b = s3["durable_s"], s3["s3fs_best_s"]
    return a / b, (
        f"{s3['size'] / 2**20:.0f} MiB to a local moto server: save() to durable {a * 1e3:.0f} ms / best plain s3fs "
        f"upload of the same bytes {b * 1e3:.0f} ms"
    )


def _s3_reshard_fetched(results: Results) -> tuple[float, str]:
    ranks = _s3(results).get("reshard")
    if not ranks:
        raise NotMeasured("the s3 reshard was skipped (--reshard-size 0)")
    per = [r["fetched"] / r["needed"] for r in ranks]
    worst = max(range(len(per)), key=per.__getitem__)
    total = sum(r["fetched"] for r in ranks) / sum(r["needed"] for r in ranks)
    return per[worst], (
        f"verified, safetensors layout; worst rank {worst}: {ranks[worst]['fetched'] / 2**20:.1f} MiB fetched / "
        f"{ranks[worst]['needed'] / 2**20:.1f} MiB needed; all ranks {total:.3f}x"
    )


def _spec(
    key: str, label: str, get: Getter, op: str = "<=", limit: float | None = None, unit: str = "x"
) -> tuple[str, str, Getter, str, float | None, str]:
    return key, label, get, op, limit, unit


def _d(num: tuple[str, str], den: tuple[str, str]) -> Getter:
    return lambda r: _div(r, num, den)


RATIO_SPECS = [
    _spec(
        "blocked_vs_memcpy",
        "worst-case blocked time / memory-copy floor (warm)",
        _d(("engine", "blocked_s"), ("engine", "memcpy_s")),
        "<=",
        1.2,
    ),
    _spec(
        "blocked_no_copy_ms",
        "worst-case blocked time, requires_copy=False payload (warm)",
        _no_copy_ms,
        "<=",
        1.0,
        " ms",
    ),
    _spec(
        "blocked_vs_dcp_async",
        "worst-case blocked time / dcp.async_save blocked time (warm)",
        _d(("engine", "blocked_s"), ("dcp", "async_blocked_s")),
        "<",
        1.0,
    ),
    _spec("loop_lock_wait_frac", "real loop: lock() wait / step without saves", _loop_wait, "<", 0.05),
    _spec("loop_step_inflight", "real loop: step with a save in flight / step without", _loop_step, "<=", 1.10),
    _spec(
        "durable_vs_raw_write",
        "time to durable / raw write+fsync floor (warm)",
        _d(("engine", "durable_s"), ("engine", "raw_write_s")),
        "<=",
        1.25,
    ),
    _spec(
        "durable_vs_dcp_save", "time to durable / dcp.save", _d(("engine", "durable_s"), ("dcp", "save_s")), "<", 1.0
    ),
    _spec(
        "durable_vs_dcp_async",
        "time to durable / dcp.async_save to durable",
        _d(("engine", "durable_s"), ("dcp", "async_durable_s")),
        "<",
        1.0,
    ),
    _spec(
        "load_vs_raw_read",
        "load into templates / raw read floor (warm)",
        _d(("engine", "load_warm_s"), ("engine", "raw_read_warm_s")),
        "<=",
        1.25,
    ),
    _spec(
        "load_vs_dcp",
        "load into templates / dcp.load (warm)",
        _d(("engine", "load_warm_s"), ("dcp", "load_warm_s")),
        "<",
        1.0,
    ),
    _spec("reshard_bytes_read", "reshard 4->8: bytes read / bytes needed (worst rank)", _reshard_bytes, "<=", 1.25),
    _spec("reshard_time", "reshard 4->8 load time / same-layout 8->8 load (warm)", _reshard_time, "<=", 2.0),
    _spec("rss_growth", "trainer RSS after all saves / after 2 saves", _rss_growth, "<=", 1.05),
    _spec("extra_rss_vs_staged", "extra resident memory / staged bytes", _extra_rss, "<=", 1.1),
    _spec(
        "first_blocked_vs_memcpy",
        "first save after construction: blocked time / memory-copy floor",
        _d(("engine", "blocked_cold_s"), ("engine", "memcpy_s")),
        "<=",
        2.0,
    ),
    _spec(
        "first_durable_vs_warm", "first save after construction: time to durable / warm save", _first_durable, "<=", 1.5
    ),
    _spec(
        "manager_ctor_s",
        "CheckpointManager construction, one rank",
        _engine_s("ctor_s", "construction"),
        "<=",
        0.1,
        " s",
    ),
    _spec(
        "manager_close_s", "close() with nothing in flight, one rank", _engine_s("close_s", "close()"), "<=", 0.1, " s"
    ),
    _spec("ranks2_first_vs_warm", "2 ranks: first save to durable / warm save", _ranks_first(2), "<=", 1.5),
    _spec("ranks2_close_s", "2 ranks: close(), slowest rank", _ranks_close(2), "<=", 0.1, " s"),
    _spec("ranks4_first_vs_warm", "4 ranks: first save to durable / warm save", _ranks_first(4), "<=", 1.5),
    _spec("ranks4_close_s", "4 ranks: close(), slowest rank", _ranks_close(4), "<=", 0.1, " s"),
    _spec("writer_peak_minus_staged", "writer process peak RSS - staged bytes", _writer_headroom, "<=", 300.0, " MiB"),
    _spec(
        "cold_load_vs_raw_read",
        "load, page cache dropped / raw read, page cache dropped (verification on)",
        _d(("engine", "load_cold_s"), ("engine", "raw_read_cold_s")),
        "<=",
        1.2,
    ),
    _spec(
        "verify_overhead",
        "default (verifying) load / the same load with verify_checksums=False (warm)",
        _d(("engine", "load_warm_s"), ("engine", "unverified_warm_s")),
        "<=",
        1.15,
    ),
    _spec(
        "ranks4_aggregate_vs_raw",
        "4 ranks saving at once: time to durable / one-process raw write of the total",
        _ranks_aggregate(4),
        "<=",
        1.3,
    ),
    _spec(
        "ranks8_aggregate_vs_raw",
        "8 ranks saving at once: time to durable / one-process raw write of the total",
        _ranks_aggregate(8),
        "<=",
        1.3,
    ),
    _spec("cuda_blocked_vs_d2h", "CUDA state: blocked time / device-to-host copy floor (pinned)", _cuda, "<=", 1.2),
    _spec(
        "cuda_first_blocked_vs_d2h",
        "CUDA state: first save blocked / device-to-host copy floor",
        _cuda_first,
        "<=",
        2.0,
    ),
    _spec(
        "scale_plan_up_s",
        "scale: plan one target rank, 70B layout resharded up (no ranks launched)",
        _scale_plan("up"),
        "<=",
        1.0,
        " s",
    ),
    _spec(
        "scale_plan_down_s",
        "scale: plan one target rank, 70B layout resharded down",
        _scale_plan("down"),
        "<=",
        1.0,
        " s",
    ),
    _spec("scale_metadata_mib", "scale: metadata.json of the larger save", _scale_meta, "<=", 64.0, " MiB"),
    # Informational rows: context for the verdicts above.
    _spec("scale_plan_growth", "scale: growth exponent of one-rank planner work (chunk checks)", _scale_growth, "info"),
    _spec("scale_bytes_read", "scale: bytes a rank reads / bytes it needs", _scale_bytes, "info"),
    _spec(
        "durable_vs_torch_save",
        "time to durable / torch.save+fsync",
        _d(("engine", "durable_s"), ("torch_save", "save_durable_s")),
        "info",
    ),
    _spec(
        "load_cold_vs_dcp",
        "load, page cache dropped / dcp.load, page cache dropped",
        _d(("engine", "load_cold_s"), ("dcp", "load_cold_s")),
        "info",
    ),
    _spec(
        "load_vs_torch_load",
        "load into templates / torch.load + copy (warm)",
        _d(("engine", "load_warm_s"), ("torch_save", "load_warm_s")),
        "info",
    ),
    _spec(
        "dcp_blocked_vs_memcpy",
        "dcp.async_save blocked time / memory-copy floor",
        _d(("dcp", "async_blocked_s"), ("engine", "memcpy_s")),
        "info",
    ),
    _spec("dcp_async_stages_copy", "dcp.async_save really copies before returning", _dcp_copy, "info"),
    _spec("reshard_time_cold", "reshard 4->8 / same-layout load, page cache dropped", _reshard_time_cold, "info"),
    _spec("reshard_disk_read", "reshard 4->8, cold: block-layer bytes / needed (all ranks)", _reshard_disk, "info"),
    _spec("writer_peak_vs_staged", "writer process peak RSS / staged bytes", _writer_rss, "info"),
    _spec("page_cache_drop", "raw read time cold / warm (checks the cache drop works)", _cache_drop, "info"),
    _spec(
        "verify_overhead_cold",
        "default (verifying) load / unverified load, page cache dropped",
        _d(("engine", "load_cold_s"), ("engine", "unverified_cold_s")),
        "info",
    ),
    _spec("s3_durable_vs_s3fs", "s3 durable vs plain s3fs upload", _s3_durable, "<=", 1.2),
    _spec("s3_reshard_fetched", "s3 reshard 4->8 bytes fetched / bytes needed", _s3_reshard_fetched, "<=", 1.1),
]

# Object storage (the s3 section, against a local moto server): also `python -m benchmarks.s3` on its own.
S3_RATIO_SPECS = [spec for spec in RATIO_SPECS if spec[0].startswith("s3_")]

RATIO_KEYS: tuple[str, ...] = tuple(s[0] for s in RATIO_SPECS)
TARGET_KEYS: tuple[str, ...] = tuple(s[0] for s in RATIO_SPECS if s[3] != "info")


def compute_ratios(
    results: Results, specs: list[tuple[str, str, Getter, str, float | None, str]] | None = None
) -> list[Ratio]:
    rows = []
    for key, label, get, op, limit, unit in RATIO_SPECS if specs is None else specs:
        row = Ratio(key=key, label=label, op=op, limit=limit, unit=unit)
        try:
            row.value, row.detail = get(results)
        except NotMeasured as why:
            row.skipped = str(why)
        except (LookupError, ZeroDivisionError, ValueError, TypeError) as exc:
            row.error = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def _verdict(r: Ratio) -> str:
    if r.skipped:
        return "n/m"
    if r.error:
        return "ERROR"
    if r.passed is None:
        return "-"
    return "PASS" if r.passed else "FAIL"


def format_table(rows: list[Ratio]) -> str:
    """A fixed-width table; also pasted into docs/performance.md."""
    head = f"| {'ratio':<24} | {'measured':>10} | {'target':>9} | {'result':<6} | detail"
    lines = [head, "|" + "-" * 26 + "|" + "-" * 12 + "|" + "-" * 11 + "|" + "-" * 8 + "|-------"]
    for r in rows:
        val = "n/a" if r.value is None else f"{r.value:.3f}{'' if r.unit == 'x' else r.unit.strip()}"
        lines.append(
            f"| {r.key:<24} | {val:>10} | {r.target:>9} | {_verdict(r):<6} | "
            f"{r.label}: {r.error or (f'not measured: {r.skipped}' if r.skipped else r.detail)}"
        )
    return "\n".join(lines)


def summary(rows: list[Ratio]) -> dict[str, Any]:
    targets = [r for r in rows if r.op != "info" and not r.skipped]
    return {
        "targets": len(targets),
        "not_measured": sorted(r.key for r in rows if r.skipped),
        "passed": sum(1 for r in targets if r.passed is True),
        "failed": sorted(r.key for r in targets if r.passed is False),
        "errors": sorted(r.key for r in rows if r.error),
    }


def to_json(results: Results, rows: list[Ratio], meta: dict[str, Any], path: Path) -> dict[str, Any]:
    doc = {
        **meta,
        "ratios": [{**asdict(r), "target": r.target, "passed": r.passed, "verdict": _verdict(r)} for r in rows],
        "summary": summary(rows),
        "sections": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str))
    return doc


def markdown_section(doc: dict[str, Any]) -> str:
    """The run's table with its machine and exact command, for docs/performance.md."""
    m = doc["machine"]
    rows = [Ratio(**{k: v for k, v in r.items() if k in Ratio.__dataclass_fields__}) for r in doc["ratios"]]
    s = doc["summary"]
    cfg = doc["config"]
    return "\n".join(
        [
            f"Command: `{doc['command']}` (wall time {doc['wall_s']:.0f} s)",
            "",
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB RAM, {m['platform']}; "
            f"Python {m['python']}, torch {m['torch']}, CUDA: {m['cuda'] or 'none'}.",
            f"State: {int(cfg['size_bytes']) / 2**20:.0f} MiB synthetic (device {cfg['device']}), "
            f"{cfg['runs']} runs per figure (median), {cfg['memory_saves']} consecutive saves, "
            f"use_direct_io={cfg['direct_io']}.",
            "",
            "```text",  # the docs label every block (tests/test_docs_examples.py)
            format_table(rows),
            "```",
            "",
            f"{s['passed']}/{s['targets']} targets pass; failed: {', '.join(s['failed']) or 'none'}; "
            f"not measured here: {', '.join(s.get('not_measured', [])) or 'none'}; "
            f"errors: {', '.join(s['errors']) or 'none'}.",
        ]
    )
