"""Faults of a real S3 server, for the attack tests (tests/test_s3_attacks.py).

* `FaultProxy`: a TCP proxy on loopback in front of the moto server. Every request is forwarded as it is,
  except those a rule names, which get a real HTTP error response (a 5xx with S3's XML error body) or no
  answer at all (the server hangs). The client talks HTTP to a socket, as it would to a real store.
* `HoldingS3FileSystem`: real s3fs requests, pausing at one step of a save (the marker's creation, the first
  data upload, the manifest's creation, the marker's removal) until a release file appears (it touches a `held`
  file first), so another process can act between two steps of a save. A module of its own so that a child
  process finds the class by name.
* `ReplacingS3FileSystem`: replaces an object on the server (a real PUT) right after the first ranged GET of
  it, so the next GET of the same read meets another version.
* `DeletingS3FileSystem`: deletes a whole checkpoint on the server (real DELETEs) right after one given request
  of a load, so its next requests meet objects that are gone.
"""

from __future__ import annotations

import re
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec.asyn
import s3fs

__all__ = ["DeletingS3FileSystem", "FaultProxy", "HoldingS3FileSystem", "ReplacingS3FileSystem", "Rule"]

_HEAD_LIMIT = 64 * 1024
_POLL_S = 0.05


LOST = -1  # a Rule's status: the server does the request, and its answer is dropped (the connection closes)


@dataclass
class Rule:
    """Requests whose `METHOD /path?query` matches `pattern` get `status` (0: no answer, the connection hangs;
    `LOST`: the server acts on it, the client gets no answer). `after`: matching requests let through first;
    `times`: how many after those fail (None: every one), so a client's retry of a transient fault succeeds.
    `until`: once a request matching it has come (one no earlier rule failed), the rule fails no more: a fault
    that lasts through every retry of one step, and ends before the next step, however many retries there were."""

    pattern: str
    status: int = 500
    code: str = "InternalError"
    after: int = 0
    times: int | None = None
    until: str = ""
    _seen: int = field(default=0, repr=False)
    _ended: bool = field(default=False, repr=False)

    def matches(self, request_line: str) -> bool:
        return re.search(self.pattern, request_line) is not None

    def fires(self, request_line: str) -> bool:
        """Whether this request fails: counts the rule's matches (one proxy thread per request; `seen` locks)."""
        if self.until and re.search(self.until, request_line):
            self._ended = True
        if self._ended or not self.matches(request_line):
            return False
        self._seen += 1
        return self._seen > self.after and (self.times is None or self._seen <= self.after + self.times)


@dataclass
class FaultProxy:
    """A loopback proxy to `upstream_port`; `rules` decide which requests fail. Use as a context manager."""

    upstream_port: int
    rules: list[Rule] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # request lines, in arrival order
    # Request headers (lower case) taken out before the request reaches the server: a store that ignores them.
    drop_headers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._rules_lock = threading.Lock()
        self._local = threading.local()  # the rule that fired for the request this thread serves
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept_thread = threading.Thread(target=self._accept_loop, name="s3-fault-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def __enter__(self) -> FaultProxy:
        self._accept_thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._accept_thread.join(10)
        for thread in self._threads:
            thread.join(10)
        self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            head = _read_head(client)
            if head is None:
                return
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            self._local.rule = rule = self._rule_for(request_line)
            lost = rule is not None and rule.status == LOST
            if not lost and self._answer(client, head, request_line):
                return
            with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30) as upstream:
                upstream.sendall(_closing(head, self.drop_headers))
                if lost:
                    _deliver_then_drop(client, upstream)
                else:
                    self._pump(client, upstream)

    def _rule_for(self, request_line: str) -> Rule | None:
        """The rule that fails this request: the first whose pattern matches and that fires for it."""
        with self._rules_lock:
            self.seen.append(request_line)
            return next((r for r in self.rules if r.fires(request_line)), None)

    def _answer(self, client: socket.socket, head: bytes, request_line: str) -> bool:
        """Answer the request here (True: the rule's error, or never for status 0), or let it through to the
        server (False). Subclasses answer some requests their own way, then call this."""
        rule: Rule | None = getattr(self._local, "rule", None)
        if rule is None:
            return False
        if rule.status == 0:
            self._stopping.wait()  # never answer: the client's read timeout must end the request
            return True
        client.sendall(_error_response(rule, head_only=request_line.startswith("HEAD ")))
        return True

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        """Copy bytes both ways until either side closes (each request has its own connection)."""
        peers = {client: upstream, upstream: client}
        while not self._stopping.is_set():
            readable, _, _ = select.select(list(peers), [], [], _POLL_S)
            for sock in readable:
                data = sock.recv(1 << 16)
                if not data:
                    return
                peers[sock].sendall(data)


def _deliver_then_drop(client: socket.socket, upstream: socket.socket) -> None:
    """Copy the request to the server and let its interim `100 Continue` through, but never its answer: once the
    server has answered (and closed: `Connection: close`), close the client's connection. The request took
    effect, and the client cannot know (a connection lost after the request)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        readable, _, _ = select.select([client, upstream], [], [], _POLL_S)
        for sock in readable:
            data = sock.recv(1 << 16)
            if sock is upstream and not data:
                return
            if sock is client and data:
                upstream.sendall(data)
            elif sock is upstream and data.startswith(b"HTTP/1.1 100"):
                client.sendall(data)


def _read_head(sock: socket.socket) -> bytes | None:
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data and len(data) < _HEAD_LIMIT:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        data += chunk
    return data


def _closing(head: bytes, drop: tuple[str, ...] = ()) -> bytes:
    """The request with `Connection: close`, so every request arrives on a connection of its own, without the
    headers named in `drop`."""
    top, _, rest = head.partition(b"\r\n\r\n")
    dropped = tuple(f"{name}:".encode() for name in ("connection", *drop))
    lines = [ln for ln in top.split(b"\r\n") if not ln.lower().startswith(dropped)]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + rest


def _error_response(rule: Rule, head_only: bool = False) -> bytes:
    """S3's error answer; to a HEAD without its body (HTTP forbids one: the client read it as a broken answer)."""
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{rule.code}</Code>'
        f"<Message>injected by the test proxy</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {rule.status} Injected\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


class HoldingS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
    """Pauses an object-store save at one step, touching `held_file`, then waiting for `release_file`:

    * `hold_on="claim"`: before it creates the `.incomplete` marker (after the manager's checks of the id);
    * `"data"`: before it uploads `model_0.pt` (after the marker is in place);
    * `"manifest"`: before it creates `manifest.json` (after every check of the commit has passed);
    * `"marker"`: before it removes the `.incomplete` marker (the commit's last step);
    * `"after marker"`: right after it removed that marker (the checkpoint committed, the save not answered yet).
    """

    def __init__(
        self, *args: Any, held_file: str = "", release_file: str = "", hold_on: str = "manifest", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.held_file, self.release_file, self.hold_on = held_file, release_file, hold_on

    def _hold(self) -> None:
        Path(self.held_file).touch()
        deadline = time.monotonic() + 120
        while not Path(self.release_file).exists() and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def pipe_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        held = {"manifest": "/manifest.json", "claim": "/.incomplete", "data": "/model_0.pt"}.get(self.hold_on)
        if self.held_file and held is not None and path.endswith(held):
            self._hold()
        # Overriding pipe_file keeps fsspec from installing its sync wrapper of `_pipe_file`: run that here.
        return fsspec.asyn.sync(self.loop, self._pipe_file, path, *args, **kwargs)

    def rm_file(self, path: str, *args: Any, **kwargs: Any) -> Any:
        marker = self.held_file and path.endswith("/.incomplete")
        if marker and self.hold_on == "marker":
            self._hold()
        removed = fsspec.asyn.sync(self.loop, self._rm_file, path, *args, **kwargs)
        if marker and self.hold_on == "after marker":
            self._hold()
        return removed


class ReplacingS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
    """After the first ranged GET of `victim`, PUTs `replacement` over it (through a second, plain client)."""

    def __init__(self, *args: Any, victim: str = "", replacement: bytes = b"", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.victim, self.replacement = victim, replacement
        self._plain = s3fs.S3FileSystem(*args, **kwargs)
        self._lock = threading.Lock()
        self.replaced = False

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with self._lock:
            if path == self.victim and not self.replaced:
                self._plain.pipe_file(path, self.replacement)
                self.replaced = True
        return data


class DeletingS3FileSystem(s3fs.S3FileSystem):  # type: ignore[misc]
    """Deletes every object under `prefix` (through a second, plain client: real DELETEs) right after the first
    request of `after` ("get": a GET, "head": a HEAD, "copy": a server-side copy from it) for the key `trigger`
    has been answered: another process deleting a checkpoint while a load (or a move) of it runs, between two of
    its requests."""

    def __init__(self, *args: Any, prefix: str = "", trigger: str = "", after: str = "get", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prefix, self.trigger, self.after = prefix, trigger, after
        self._plain = s3fs.S3FileSystem(*args, **kwargs)
        self._lock = threading.Lock()
        self.deleted: list[str] = []

    def _after(self, kind: str, path: str) -> None:
        with self._lock:
            if kind != self.after or path != self.trigger or self.deleted:
                return
            self._plain.invalidate_cache()
            self.deleted = [k for k in self._plain.find(self.prefix) if k.startswith(self.prefix + "/")]
            self._plain.rm(self.deleted)
            self.invalidate_cache()

    # Overriding these keeps fsspec from installing its sync wrappers of the async methods: run those here.
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        data = fsspec.asyn.sync(self.loop, self._cat_file, path, start=start, end=end, **kwargs)
        self._after("get", path)
        return data

    def info(self, path: str, **kwargs: Any) -> Any:
        out = fsspec.asyn.sync(self.loop, self._info, path, **kwargs)
        self._after("head", path)
        return out

    def size(self, path: str) -> Any:
        out = fsspec.asyn.sync(self.loop, self._size, path)
        self._after("head", path)
        return out

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> Any:
        out = fsspec.asyn.sync(self.loop, self._cp_file, path1, path2, **kwargs)
        self._after("copy", path1)
        return out

    def call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A GET the storage makes itself (a manifest's, held to its ETag) counts as one of `cat_file`'s."""
        out = fsspec.asyn.sync(self.loop, self._call_s3, method, *args, **kwargs)
        if method == "get_object":
            self._after("get", f"{kwargs['Bucket']}/{kwargs['Key']}")
        return out
