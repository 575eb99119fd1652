"""An S3 filesystem with test hooks, passed to the storage through `FsspecStorageConfig.filesystem`.

Its own module so that it imports s3fs (an optional extra) only when a test asks for it, and so that pickling
finds the class by name in writer processes and ranks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import s3fs


class InstrumentedS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
    """Real S3 requests through s3fs's public methods, plus: every ranged GET recorded (in `gets`, and as a
    `pid<TAB>key<TAB>start<TAB>end` line in `gets_log`), and a pause of `part_delay_s` after each uploaded
    multipart part, with `signal_file` touched once one is up. Its hook arguments are constructor keywords,
    so it pickles (fsspec rebuilds a filesystem from them) into writer processes and ranks."""

    def __init__(
        self, *args: Any, gets_log: str = "", signal_file: str = "", part_delay_s: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.gets: list[tuple[str, int, int]] = []
        self.gets_log, self.signal_file, self.part_delay_s = gets_log, signal_file, part_delay_s

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        self._record(path, start or 0, end or 0)
        return super().cat_file(path, start=start, end=end, **kwargs)

    def _record(self, path: str, start: int, end: int) -> None:
        self.gets.append((path, start, end))
        if self.gets_log:
            with open(self.gets_log, "a") as log:
                log.write(f"{os.getpid()}\t{path}\t{start}\t{end}\n")

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "get_object":  # the storage's own GET (a manifest's or a small object's, held to its ETag)
            first, _, last = str(kwargs.get("Range", "bytes=0-")).removeprefix("bytes=").partition("-")
            self._record(f"{kwargs['Bucket']}/{kwargs['Key']}", int(first or 0), int(last) + 1 if last else 0)
        out = super().call_s3(method, *args, **kwargs)
        if method == "upload_part":
            if self.signal_file:
                Path(self.signal_file).touch()
            time.sleep(self.part_delay_s)
        return out
