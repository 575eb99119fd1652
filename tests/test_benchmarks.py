"""Smoke test of the benchmark harness: it runs end to end on a few MiB and
reports every ratio with a target and a verdict. No timing assertions: the
numbers of a smoke run on a busy machine mean nothing, their presence does."""

from __future__ import annotations

import json
import math
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cli import main, parse_size
from benchmarks.config import BenchConfig, MiB
from benchmarks.report import RATIO_KEYS, TARGET_KEYS, compute_ratios, format_table, summary
from benchmarks.sweep import plot
from tests.s3_server import S3Server


@pytest.mark.multirank
def test_quick_run_reports_every_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    rc = main(
        [
            "--quick",
            "--size",
            "4M",
            "--runs",
            "2",
            "--memory-saves",
            "3",
            "--device",
            "cpu",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--timeout",
            "480",  # per section; the s3 section's 8-rank load gets a quarter (60 s at 240 ran out under CI's load)
            "--scale-dp",
            "4",
            "--scale-layers",
            "2",
        ]
    )
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    by_key = {r["key"]: r for r in doc["ratios"]}
    assert set(by_key) == set(RATIO_KEYS)
    broken = {k: r["error"] for k, r in by_key.items() if r["error"]}
    assert not broken, f"ratios that could not be measured: {broken}"
    # Rows this machine cannot measure: CUDA (no device in CI), 8 ranks (--quick runs 2 and 4).
    skipped = {k for k, r in by_key.items() if r["skipped"]}
    assert skipped == {"cuda_blocked_vs_d2h", "cuda_first_blocked_vs_d2h", "ranks8_aggregate_vs_raw"}
    for key, row in by_key.items():
        assert key in printed, f"{key} missing from the printed table"
        if key in skipped:
            assert row["verdict"] == "n/m" and row["value"] is None, key
            continue
        assert isinstance(row["value"], float) and math.isfinite(row["value"]), key
        if key in TARGET_KEYS:
            assert row["verdict"] in ("PASS", "FAIL") and row["passed"] is (row["verdict"] == "PASS"), key
    assert rc == 0
    assert doc["summary"]["targets"] == len(TARGET_KEYS) - len(skipped)
    assert doc["summary"]["not_measured"] == sorted(skipped)
    assert doc["machine"]["cores"] and doc["command"].startswith("python -m benchmarks")
    # the benchmark must clean up its checkpoints
    assert not any((tmp_path / "work").iterdir())


@pytest.mark.multirank
def test_ranks_floor_writes_the_ranks_bytes_and_builds_them_once(tmp_path: Path) -> None:
    """The ranks section's floor is one process writing what all ranks save: rank 0 builds the other ranks'
    states once (it rebuilt a state of the whole total, with its own seed and a rounding of its own, before
    every sample: 1 GiB of random numbers per sample, and 0.5% more bytes than the ranks wrote)."""
    from benchmarks.state import make_state, nbytes
    from simulator.launcher import launch
    from tests.bench_jobs import ranks_rank_run_counting_states

    world, runs, per = 2, 3, MiB
    cfg = BenchConfig(size_bytes=world * per, direct_io=False)
    out = launch(ranks_rank_run_counting_states, world, args=(cfg, str(tmp_path), runs), timeout=240, name="t-ranks")
    assert [r["state_seeds"] for r in out] == [[(per, 0), (per, 1)], [(per, 1)]]
    total = sum(nbytes(make_state(per, seed=r)) for r in range(world))
    assert out[0]["total"] == total
    assert out[0]["floor_bytes"] == [total] * runs and len(out[0]["floor_s"]) == runs
    assert not any(tmp_path.glob("raw_floor*")), "the floor file is removed"


def test_failed_section_still_lists_every_ratio() -> None:
    results = {"engine": {"error": "ImportError: no engine", "wall_s": 0.1}}
    rows = compute_ratios(results)
    assert [r.key for r in rows] == list(RATIO_KEYS)
    engine_rows = [r for r in rows if r.key == "blocked_vs_memcpy"]
    assert engine_rows[0].error and "no engine" in engine_rows[0].error
    # rows of the failed section are errors; rows of sections this invocation did not run are "not measured"
    table = format_table(rows)
    assert table.count("ERROR") == sum(1 for r in rows if r.error) > 0
    assert all(bool(r.error) != bool(r.skipped) for r in rows)
    assert all("was not run" in (r.skipped or "") for r in rows if r.skipped)


def test_scale_section_builds_metadata_and_plans(tmp_path: Path) -> None:
    """The --scale plumbing on a tiny layout (2 layers, 16 -> 32 ranks): metadata written and parsed, every
    sampled rank planned with nothing left uncovered, the growth fit and the report rows filled in."""
    from benchmarks import scale

    cfg = BenchConfig(scale_dp=2, scale_layers=2, quick=True)
    res = scale.run(cfg, tmp_path)
    assert res["layers"] == 2 and res["params"] == scale.param_count(scale.model_layout(scale.ModelShape(layers=2)))
    for which, (src, dst) in {"up": ((2, 8), (4, 8)), "down": ((4, 8), (2, 8))}.items():
        sc = res[which]
        assert (tuple(sc["src"]), tuple(sc["dst"])) == (src, dst)
        assert sc["tensors"] == 3 * len(scale.model_layout(scale.ModelShape(layers=2)))
        assert sc["metadata_bytes"] > 0 and sc["ranks"]
        for r in sc["ranks"]:
            assert r["needed"] > 0 and r["read"] >= r["needed"] and r["plans"] >= sc["tensors"]
    assert [g["dst_world"] for g in res["growth"]] == [16, 32]
    assert math.isfinite(res["growth_exponent"])
    rows = {r.key: r for r in compute_ratios({"scale": {"result": res}})}
    for key in ("scale_plan_up_s", "scale_plan_down_s", "scale_metadata_mib", "scale_plan_growth", "scale_bytes_read"):
        assert rows[key].error is None and rows[key].value is not None, key


_SCALE_UNDER_NO_FILES = """
import json, sys
from pathlib import Path
from benchmarks import scale
from benchmarks.config import BenchConfig
res = scale.run(BenchConfig(scale_dp=2, scale_layers=2, quick=True), Path(sys.argv[1]))
print(json.dumps({w: {k: res[w][k] for k in ("metadata_bytes", "serialise_s", "parse_s")} for w in ("up", "down")}))
"""


def _no_file_bytes() -> None:
    """RLIMIT_FSIZE 0: any byte written to a file fails with EFBIG (SIGXFSZ ignored, so it raises, not kills)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def test_scale_times_serialise_and_parse_in_memory_without_the_disk(tmp_path: Path) -> None:
    """The scale figures are pure computation: the metadata is serialised to bytes and those bytes parsed,
    with no file in between, so parse_s cannot include a disk read (it did: the JSON went to disk and
    back, and the read was timed as parsing). Proved with the real limit: not one byte may reach a file."""
    proc = subprocess.run(
        [sys.executable, "-c", _SCALE_UNDER_NO_FILES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_no_file_bytes,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for which, f in figures.items():
        assert f["metadata_bytes"] > 0, which
        assert 0 < f["serialise_s"] < 60 and 0 < f["parse_s"] < 60, (which, f)
    assert not any(tmp_path.rglob("*")), "the scale section creates nothing on disk"


def test_scale_layout_is_a_70b_transformer() -> None:
    from benchmarks import scale

    layout = scale.model_layout(scale.ModelShape())
    assert len(layout) == 723 and 70e9 < scale.param_count(layout) < 71e9


def test_rows_without_a_device_are_not_measured_not_errors() -> None:
    results = {"engine": {"result": {"device": "cpu", "blocked_s": [1.0], "memcpy_s": [1.0]}, "wall_s": 1.0}}
    rows = {r.key: r for r in compute_ratios(results)}
    assert rows["cuda_blocked_vs_d2h"].skipped and rows["cuda_blocked_vs_d2h"].error is None
    s = summary(list(rows.values()))
    assert "cuda_blocked_vs_d2h" in s["not_measured"] and "cuda_blocked_vs_d2h" not in s["errors"]
    assert "n/m" in format_table(list(rows.values()))


def test_parse_size_and_bad_config() -> None:
    assert parse_size("1G") == 1 << 30
    assert parse_size("256MiB") == 256 * MiB
    assert parse_size("4096") == 4096
    with pytest.raises(ValueError, match="Unknown benchmark section"):
        BenchConfig(sections=("nope",))
    with pytest.raises(ValueError, match="scale_dp"):
        BenchConfig(scale_dp=1)
    with pytest.raises(SystemExit):
        main(["--size", "lots"])


def test_scale_alone_has_time_for_a_busy_machine_and_help_names_the_timeouts() -> None:
    """`--scale` alone is about 4 CPU-minutes of one core; on 2 cores at load ~10 it took 731 s, and the
    600 s section default killed it (every scale row ERROR). Run alone, with nothing to protect but a hang,
    it gets the longer bound; an explicit --timeout still wins, and --help says which default applies."""
    from benchmarks.cli import build_parser, config_from_args

    def timeout(*argv: str) -> float:
        return config_from_args(build_parser().parse_args(list(argv))).section_timeout_s

    alone = timeout("--scale")
    assert alone > 731, f"--scale alone gets {alone:.0f} s: less than a measured busy-machine run"
    assert timeout("--sections", "scale") == alone
    assert timeout("--scale", "--timeout", "90") == 90
    assert timeout() == BenchConfig().section_timeout_s < alone
    assert timeout("--quick", "--scale") == BenchConfig.quick_config().section_timeout_s
    text = " ".join(build_parser().format_help().split())
    for default in (BenchConfig().section_timeout_s, BenchConfig.quick_config().section_timeout_s, alone):
        assert f"{default:.0f}" in text, default
    assert "under 2 minutes" not in text


def test_plot_is_skipped_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    doc = {"sizes": [MiB], "blocked": {"ours": [0.1]}, "durable": {"ours": [0.2]}, "machine": {"cpu": "x", "cores": 2}}
    msg = plot(doc, tmp_path / "p.png")
    assert "skipped" in msg and "matplotlib" in msg
    assert not (tmp_path / "p.png").exists()


def test_the_timed_construction_imports_no_engine_module() -> None:
    """`manager_ctor_s` times the constructor: every module it needs was imported before the clock started
    (the package's lazy exports once left checkpoint_manager's whole import tree inside the timing)."""
    program = (
        "import sys, torch\n"
        "from benchmarks.config import BenchConfig\n"
        "from benchmarks.engine_api import import_engine, make_manager\n"
        "import_engine()\n"
        "before = set(sys.modules)\n"
        "manager = make_manager(BenchConfig())\n"
        "manager.close()\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch_checkpointing')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1]
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_markdown_section_labels_its_block_as_the_docs_require() -> None:
    """`--markdown` output is pasted into docs/performance.md, whose blocks must each say what they are."""
    from benchmarks.report import markdown_section

    doc = {
        "command": "python -m benchmarks",
        "wall_s": 1.0,
        "machine": {"cpu": "x", "cores": 2, "memory_gib": 1, "platform": "p", "python": "3", "torch": "t"}
        | {"cuda": None},
        "config": {"size_bytes": 2**20, "device": "cpu", "runs": 1, "memory_saves": 1, "direct_io": True},
        "ratios": [],
        "summary": {"passed": 0, "targets": 0, "failed": [], "errors": []},
    }
    fences = [line for line in markdown_section(doc).splitlines() if line.startswith("```")]
    assert fences == ["```text", "```"]


def test_the_timed_loads_start_no_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's loads are timed next to a raw read on the same cores: a process started for them (the
    unverified manager's writer, importing torch) was timed with the first loads."""
    import benchmarks.engine as engine
    from benchmarks.common import build_state
    from benchmarks.engine_api import make_manager
    from benchmarks.sysinfo import descendants

    cfg = BenchConfig(size_bytes=MiB, runs=1, work_parent=tmp_path)
    state = build_state(cfg)
    saver = make_manager(cfg, sync_save=True)
    last = tmp_path / "ckpt"
    try:
        saver.save(str(last), state)
        floors = engine._Floors(state, cfg, tmp_path)
        floors.before_save()  # writes the raw-read floor's file
        before = set(descendants())
        started: list[set[int]] = []
        real_now = engine.now

        def now_and_look() -> float:
            started.append(set(descendants()) - before)
            return real_now()

        monkeypatch.setattr(engine, "now", now_and_look)
        engine._loads(saver, last, state, cfg, floors)
    finally:
        saver.close()
    assert len(started) == 8  # two clock reads per load: cold and warm, verified and not
    assert not any(started), f"processes started while loads were timed: {started}"


def test_the_s3_counting_storage_forwards_every_public_storage_method() -> None:
    """A method it did not forward would run `Storage`'s default over the forwarded ones (a `read_range` reading
    the whole stream): the benchmark would measure another load than the engine's."""
    from benchmarks.s3 import CountingStorage
    from torch_checkpointing.storage.base_storage import Storage

    public = {name for name, value in vars(Storage).items() if callable(value) and not name.startswith("_")}
    assert public, "no public Storage methods found: the check would pass on nothing"
    assert sorted(public - set(vars(CountingStorage))) == []


def test_the_s3_counting_storage_counts_what_its_reads_return(tmp_path: Path) -> None:
    """`read`, `read_range`, `read_sized` and a stream read all the way count their bytes; writes and listings
    count none."""
    pytest.importorskip("fsspec")
    from benchmarks.s3 import CountingStorageConfig
    from torch_checkpointing import FsspecStorageConfig
    from torch_checkpointing.storage.base_storage import ReadArgs

    config = CountingStorageConfig(FsspecStorageConfig(url=f"memory://bench-count-{tmp_path.name}"))
    storage = config.create_storage()
    storage.write(Path("a/x"), b"0123456789")
    assert storage.ls(Path("a")) == ["x"] and config.fetched == 0
    assert storage.read(Path("a/x")) == b"0123456789"
    assert storage.read_range(Path("a/x"), 2, 3) == b"234"
    with storage.stream_read(Path("a/x"), ReadArgs(pre_read_full_file=False)) as stream:
        assert stream.read() == b"0123456789"
    assert config.fetched == 10 + 3 + 10
    assert storage.read_sized(Path("a/x"), 100) == (10, b"0123456789")
    assert storage.read_sized(Path("a/x"), 5) == (10, None)  # larger than the limit: nothing read, nothing counted
    assert config.fetched == 10 + 3 + 10 + 10
    storage.rmdir(Path("a"))


def test_the_s3_counting_storage_counts_the_bytes_of_every_get_a_load_sends(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The s3 section's count, taken on the public Storage API, is the bytes of the GETs the resharding load sent
    (logged by the S3 filesystem itself): what the count inside the engine's S3 storage measured before."""
    import os
    import warnings

    import torch

    from benchmarks.s3 import CountingStorageConfig
    from tests.s3_server import RecordingStorageConfig, logged_gets
    from tests.test_verified_loads import AlwaysReshard
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.checkpoint_layout import LayoutInfo, SafetensorsSerialization
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.base_storage import StorageConfig

    base = s3_server.config()
    log = tmp_path / "gets.log"
    recording = RecordingStorageConfig(
        url=base.url, storage_options=base.storage_options, part_size=base.part_size, gets_log=str(log)
    )
    layout = LayoutInfo("model/{rank}.safetensors", SafetensorsSerialization())

    def manager(storage_config: StorageConfig) -> CheckpointManager:
        items = {"model": ItemSpec(resharder=AlwaysReshard(), layout=layout)}
        conf = CheckpointManager.Config(items=items, save=SyncCheckpointSaverConfig(), storage_config=storage_config)
        return CheckpointManager(conf)

    values = {"a": torch.arange(3 * MiB // 4, dtype=torch.float32), "b": torch.ones(MiB // 4)}
    with manager(recording) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.save("run/step_1", {"model": values})
    counting = CountingStorageConfig(recording)
    before = len(logged_gets(log, os.getpid()))
    target = {"a": torch.zeros(3 * MiB // 4)}
    with manager(counting) as m, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*plain.*")
        m.load("run/step_1", into={"model": target}, strict=False)
    assert torch.equal(target["a"], values["a"])
    gets = logged_gets(log, os.getpid())[before:]
    assert any(start > 0 for _, start, _ in gets), f"no ranged GET: the resharding read path was not taken: {gets}"
    assert counting.fetched == sum(end - start for _, start, end in gets) > 0
