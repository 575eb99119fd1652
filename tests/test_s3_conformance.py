"""`pytest conformance --storage-url s3://...` against a real local S3 server (moto, tests/s3_server.py).

A representative subset of the clauses (formats, layouts, loads, one 2-rank launch, one integrity clause) runs
as a user runs it: pytest in a subprocess whose environment names the endpoint (`AWS_ENDPOINT_URL`), which the
ranks and async writer processes inherit. The checks read the clause report and look in the bucket itself, so
a suite that quietly wrote to a local directory, or counted a local-only clause as passed, fails them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conformance.clauses import LOCAL_ONLY, fold
from tests.s3_server import S3Server
from torch_checkpointing.storage.fsspec_storage import FsspecStorage, FsspecStorageConfig

ROOT = Path(__file__).resolve().parent.parent
_RUN_TIMEOUT_S = 240

# One or more tests per area; the 2-rank launch is the costly part (every 2-rank clause shares it).
SUBSET = (
    "conformance/test_formats.py::test_torch_nested_state_roundtrip",
    "conformance/test_formats.py::test_json_sorted_and_indented",
    "conformance/test_formats.py::test_raw_bytes_as_is",
    "conformance/test_formats.py::test_safetensors_flattens_to_dotted_keys",
    "conformance/test_formats.py::test_safetensors_metadata_in_header",
    "conformance/test_layouts.py::test_per_rank_subdirectory",
    "conformance/test_layouts.py::test_key_placeholder_stays_literal",
    "conformance/test_load.py::test_templates_filled_in_place",
    "conformance/test_load.py::test_declaring_a_resharder_is_enough",
    "conformance/test_load.py::test_first_example_with_defaults",
    "conformance/test_durability.py::test_deleted_file_is_detected",
    "conformance/test_multirank.py::test_rank_placeholder_per_rank",
)
MEASURED_ON_S3 = (
    "TORCH-ROUNDTRIP-1",
    "JSON-PRETTY-1",
    "RAW-BYTES-1",
    "ST-FLATTEN-1",
    "ST-META-1",
    "LAYOUT-SUBDIR-1",
    "LAYOUT-BRACES-1",
    "LOAD-INPLACE-1",
    "RESHARD-AUTO-1",
    "INTEG-DELETE-1",
    "LAYOUT-RANK-4",
)


def _env(server: S3Server) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONFORMANCE_")}
    return {**env, "PYTHONPATH": path, **server.client_env()}


def _objects(server: S3Server, bucket: str) -> list[str]:
    storage = FsspecStorage(FsspecStorageConfig(protocol="s3", storage_options=server.storage_options()))
    storage.fs.invalidate_cache()
    return sorted(storage.fs.find(bucket))


@pytest.mark.multirank
def test_conformance_subset_passes_against_s3_and_writes_into_the_bucket(s3_server: S3Server, tmp_path: Path) -> None:
    bucket = f"conf-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    report, basetemp = tmp_path / "clauses.json", tmp_path / "basetemp"
    options = ["--basetemp", str(basetemp), "--storage-url", f"s3://{bucket}/run", "--clause-report", str(report)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *SUBSET, "-q", "-n", "0", "-p", "no:cacheprovider", *options],
        cwd=ROOT,
        env=_env(s3_server),
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    result = json.loads(report.read_text())
    clauses = result["clauses"]
    assert {c: clauses.get(c) for c in MEASURED_ON_S3} == dict.fromkeys(MEASURED_ON_S3, "passed"), out[-3000:]
    # The first example uses the default (local) storage: not measured on S3, with its premise, never "passed".
    assert clauses["EXAMPLE-DEFAULTS-1"] == "not measured"
    assert "local filesystem only" in result["reasons"]["EXAMPLE-DEFAULTS-1"]
    # Every checkpoint is in the bucket (manifest = committed) and none on the local disk.
    manifests = [o for o in _objects(s3_server, bucket) if o.endswith("/manifest.json")]
    assert any("/multirank/layouts/" in o for o in manifests), manifests
    assert len(manifests) >= len(SUBSET), manifests
    assert not list(basetemp.rglob("manifest.json")), "a checkpoint was written to the local disk"


def test_local_only_outcome_folds_to_not_measured_unless_another_test_measured_the_clause() -> None:
    assert fold({"A": [LOCAL_ONLY]}) == {"A": "not measured"}
    assert fold({"A": [LOCAL_ONLY, LOCAL_ONLY]}) == {"A": "not measured"}
    assert fold({"A": ["passed", LOCAL_ONLY]}) == {"A": "passed"}
    assert fold({"A": ["failed", LOCAL_ONLY]}) == {"A": "failed"}
    assert fold({"A": ["skipped", LOCAL_ONLY]}) == {"A": "not measured"}
