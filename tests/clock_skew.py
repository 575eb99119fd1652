"""A process whose wall clock is off: an LD_PRELOAD shim that shifts CLOCK_REALTIME by an offset.

A host whose clock differs from its store's (an NFS server's, which stamps ctime and mtime; an object store's,
which stamps LastModified) is made for one real process: `clock_gettime`, `gettimeofday` and `time` read the
real clock plus `SKEWED_CLOCK_OFFSET_S` seconds; the kernel, which stamps the files, keeps the true time, as a
file server does. `SKEWED_HOSTNAME` also makes the process another host (`gethostname`): the names it reads
were made elsewhere, and their pids name no process of its own. Built with the C compiler of this machine; a
test skips only where there is none.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

__all__ = ["skewed_env", "stated_age_s"]

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

static long long offset_ns(void) {
    static int read;
    static long long ns;
    if (!read) {
        const char *s = getenv("SKEWED_CLOCK_OFFSET_S");
        ns = s ? (long long)(atof(s) * 1e9) : 0;
        read = 1;
    }
    return ns;
}

static void shift(struct timespec *ts) {
    long long t = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + offset_ns();
    ts->tv_sec = (time_t)(t / 1000000000LL);
    ts->tv_nsec = (long)(t % 1000000000LL);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    static int (*real)(clockid_t, struct timespec *);
    if (!real) real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    int r = real(id, ts);
    if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) shift(ts);
    return r;
}

int gettimeofday(struct timeval *tv, void *tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0) return -1;
    if (tv) { tv->tv_sec = ts.tv_sec; tv->tv_usec = ts.tv_nsec / 1000; }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    if (out) *out = ts.tv_sec;
    return ts.tv_sec;
}

int gethostname(char *name, size_t len) {
    static int (*real)(char *, size_t);
    const char *fake = getenv("SKEWED_HOSTNAME");
    if (fake == NULL) {
        if (!real) real = (int (*)(char *, size_t))dlsym(RTLD_NEXT, "gethostname");
        return real(name, len);
    }
    if (strlen(fake) + 1 > len) return -1;
    strcpy(name, fake);
    return 0;
}
"""


def _compiler() -> str | None:
    return next((found for cc in ("cc", "gcc", "clang") if (found := shutil.which(cc))), None)


def skewed_env(tmp_path: Path, offset_s: float, hostname: str | None = None) -> dict[str, str]:
    """The environment of a child process whose clock reads `offset_s` seconds ahead of the true time (behind
    where negative), and whose hostname is `hostname` where given. Skips the test where no C compiler is found."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) found to build the clock-skew LD_PRELOAD shim")
    source, shim = tmp_path / "skew.c", tmp_path / "skew.so"
    if not shim.exists():
        source.write_text(_SHIM)
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(source), "-ldl"], check=True, timeout=120)
    env = {**os.environ, "LD_PRELOAD": str(shim), "SKEWED_CLOCK_OFFSET_S": str(offset_s)}
    if hostname is not None:
        env["SKEWED_HOSTNAME"] = hostname
    return env


def stated_age_s(why: str) -> int:
    """The age gc's reason for keeping a leftover states ("... only 3s old (< 60s)"). A test compares it with a
    bound, never with an exact value: a leftover made "a moment ago" is 0 s or 1 s old by the time gc reads it,
    depending on how busy the machine is."""
    ages = re.findall(r"only (\d+)s old", why)
    assert len(ages) == 1, why
    return int(ages[0])
