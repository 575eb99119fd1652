"""`import_hf` refuses, before copying a byte, a shard larger than the memory it could be copied into.

The import copies each shard into an anonymous in-memory file (`cold_read.private_copy`) before safetensors reads
it, as a load does each checkpoint file; the load refuses a file larger than the memory and swap available up
front (`cold_read.refuse_beyond_memory`), the import did not: a sparse 1 TiB shard (no disk used, a download
`truncate`d to a wrong size) was copied until the machine ran out. The old code's copy is stopped here by
RLIMIT_FSIZE (it applies to writes into the in-memory file), so the test never fills this machine's memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_IMPORT = """
import json, os, resource, signal, struct, sys
from torch_checkpointing.hf import import_hf
folder, indexed = sys.argv[1], sys.argv[2] == "indexed"
shard = os.path.join(folder, "model-00001-of-00001.safetensors" if indexed else "model.safetensors")
size = 1 << 40
header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
header += b" " * (-len(header) % 8)
with open(shard, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header)
os.truncate(shard, 8 + len(header) + size)  # a whole 1 TiB shard, sparse: no disk used
if indexed:  # no look at the shard's header before the import copies it
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {"w": os.path.basename(shard)}}, f)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 20, resource.RLIM_INFINITY))  # the old code's copy stops here
def written():  # bytes this process wrote (write, sendfile, copy_file_range: the copy's calls), from the kernel
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
start = written()
try:
    import_hf(folder)
    print("imported")
except Exception as exc:
    said = "named" if shard in str(exc) else "-"
    print(type(exc).__name__, said, written() - start, repr(str(exc)[-300:]))
"""


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the copy is made only where memfd is")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/meminfo says what memory there is")
@pytest.mark.parametrize("series", ["single", "indexed"])
def test_a_shard_larger_than_memory_is_refused_before_its_copy(tmp_path: Path, series: str) -> None:
    """Defect: a lone shard's header look (a map of the shard) raised a bare "RuntimeError - ... unable to mmap
    1099511627872 bytes from file </proc/self/fd/3>: Cannot allocate memory (12)", naming nothing; an indexed
    shard's copy ran until RLIMIT_FSIZE stopped it at 256 MiB; without that limit, until the machine's memory ran
    out."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT, str(tmp_path), series], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kind, said, written, message = done.stdout.strip().splitlines()[-1].split(" ", 3)
    assert (kind, said) == ("MemoryError", "named"), done.stdout
    assert "not found damaged" in message, message
    # Refused before copying: counted in bytes written, not in seconds (a bound in seconds is a guess about the
    # machine's load). The old copy wrote up to RLIMIT_FSIZE (256 MiB) first; a log line or two is all else.
    assert int(written) < 1 << 20, done.stdout
