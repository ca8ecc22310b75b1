"""A protocol-faithful stand-in for kube-apiserver, for tests that drive the real
`kubernetes` client: list and watch of Services, EndpointSlices and Nodes over real
HTTP/1.1 on 127.0.0.1, with the API's resourceVersion, selector, bookmark and
410-Expired semantics, and hooks to break the connection in the ways a network does.

State changes only through Python methods (create/update/apply/delete); the HTTP side
is read-only (GET), which is all a kube-proxy needs.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class _Kind:
    kind: str
    api_version: str
    plural: str
    prefix: str  # URL prefix of the group/version
    namespaced: bool


KINDS: dict[str, _Kind] = {
    k.kind: k
    for k in (
        _Kind("Service", "v1", "services", "/api/v1", True),
        _Kind(
            "EndpointSlice",
            "discovery.k8s.io/v1",
            "endpointslices",
            "/apis/discovery.k8s.io/v1",
            True,
        ),
        _Kind("Node", "v1", "nodes", "/api/v1", False),
    )
}


class BadRequest(ValueError):
    """A query the real API would answer with 400 BadRequest."""


# --- selectors -------------------------------------------------------------

Labels = dict[str, str]
Requirement = Callable[[Labels], bool]

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_RE = re.compile(rf"^({_KEY})\s+(in|notin)\s*\((.*)\)$")
_OP_RE = re.compile(rf"^({_KEY})\s*(==|!=|=)\s*({_VALUE})$")
_EXISTS_RE = re.compile(rf"^(!?)\s*({_KEY})$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: `a in (x,y),b` is two requirements."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts]


def _requirement(term: str) -> Requirement:
    if m := _SET_RE.match(term):
        key, op = m.group(1), m.group(3)
        values = {v.strip() for v in m.group(4).split(",")}
        if not values or not all(re.fullmatch(_VALUE, v) for v in values):
            raise BadRequest(f"invalid label selector term {term!r}")
        if op == "in":
            return lambda labels: labels.get(key) in values
        # notin also matches objects without the key, as in the API.
        return lambda labels: labels.get(key) not in values
    if m := _OP_RE.match(term):
        key, op, value = m.group(1), m.group(3), m.group(4)
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: key in labels and labels[key] == value
    if m := _EXISTS_RE.match(term):
        negated, key = m.group(1) == "!", m.group(2)
        return lambda labels: (key in labels) != negated
    raise BadRequest(f"invalid label selector term {term!r}")


def parse_label_selector(text: str) -> Requirement:
    """The API's label selector syntax: `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
    `k notin (a,b)`, `k`, `!k`, joined by commas (all must hold)."""
    if not text.strip():
        return lambda labels: True
    reqs = [_requirement(term) for term in _split_top_level(text)]
    return lambda labels: all(r(labels) for r in reqs)


def parse_field_selector(text: str) -> Callable[[dict], bool]:
    """`metadata.name` and `metadata.namespace` with `=`, `==`, `!=`: the fields every
    kind supports. Others are refused, as the API refuses fields a kind lacks."""
    checks: list[Callable[[dict], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = re.fullmatch(r"(metadata\.name|metadata\.namespace)\s*(==|!=|=)\s*(.*)", term)
        if not m:
            raise BadRequest(f'field label not supported: "{term}"')
        field, op, value = m.group(1).split(".")[1], m.group(2), m.group(3)

        def check(obj: dict, field: str = field, op: str = op, value: str = value) -> bool:
            return (obj["metadata"].get(field, "") == value) != (op == "!=")

        checks.append(check)
    return lambda obj: all(c(obj) for c in checks)


# --- the server ------------------------------------------------------------


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    kind: str
    old: dict | None  # the object before (MODIFIED, DELETED)
    new: dict | None  # the object after (ADDED, MODIFIED)


@dataclass
class _Query:
    kind: _Kind
    namespace: str | None  # None: all namespaces (or a cluster-scoped kind)
    name: str | None
    params: dict[str, str]

    def matcher(self) -> Callable[[dict], bool]:
        labels = parse_label_selector(self.params.get("labelSelector", ""))
        fields = parse_field_selector(self.params.get("fieldSelector", ""))

        def matches(obj: dict) -> bool:
            meta = obj["metadata"]
            if self.namespace is not None and meta.get("namespace") != self.namespace:
                return False
            return labels(meta.get("labels") or {}) and fields(obj)

        return matches


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _with_rv(obj: dict, rv: int) -> dict:
    out = dict(obj)
    out["metadata"] = {**obj["metadata"], "resourceVersion": str(rv)}
    return out


def _without_type_meta(obj: dict) -> dict:
    # List items come without kind/apiVersion from the real API.
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


class TestApiServer:
    """kube-apiserver's list/watch for Services, EndpointSlices and Nodes.

    All hooks are thread-safe. resourceVersions are one global counter, as etcd's
    revision is; watch history is bounded by `history_size` events."""

    __test__ = False  # not a pytest test class

    def __init__(self, bookmark_interval: float = 1.0, history_size: int = 1000) -> None:
        self._bookmark_interval = bookmark_interval
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._cond = threading.Condition()
        self._objects: dict[str, dict[tuple[str, str], dict]] = {k: {} for k in KINDS}
        # Real resourceVersions are large and opaque; not starting at 1 keeps tests
        # from leaning on small numbers.
        self._rv = 100
        self._history: deque[_Event] = deque(maxlen=history_size)
        self._floor = self._rv  # a watch from rv X needs X >= floor
        self._lost_upto = 0  # events up to here are gone: watchers behind it are cut
        self._drop_generation = 0
        self._hanging = False
        self._stopped = True
        self._port = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._serve_thread: threading.Thread | None = None
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._watch_sockets: set[socket.socket] = set()
        self._snapshots: dict[str, tuple[int, list[bytes]]] = {}  # continue token -> rest
        # each stored object as a list item (JSON), made as it is stored: (the object it
        # was made from, the JSON). The real API server encodes lists from its watch cache,
        # in Go; this one, encoding them in Python as they are asked for, would spend as
        # much CPU on an agent's first list as the agent does (200,000 objects), on the
        # same cores, and a benchmark of the agent's start would time this server
        self._encoded: dict[int, tuple[dict, bytes]] = {}
        self.start()

    # --- lifecycle -------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def start(self) -> None:
        """Listen again, on the same port as before (an OS-chosen one the first time)."""
        with self._cond:
            if not self._stopped:
                return
            httpd = ThreadingHTTPServer(("127.0.0.1", self._port), self._handler_class())
            httpd.daemon_threads = True
            httpd.block_on_close = False  # stop() cuts the connections, then joins
            self._port = httpd.server_address[1]
            self._httpd = httpd
            self._stopped = False
        self._serve_thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._serve_thread.start()

    def stop(self) -> None:
        """Go down: stop listening (connections are refused), cut every open
        connection, and wait for the server's threads. The state is kept."""
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            httpd, self._httpd = self._httpd, None
            connections = list(self._connections.items())
            self._cond.notify_all()
        assert httpd is not None and self._serve_thread is not None
        httpd.shutdown()
        httpd.server_close()  # refuse from here on
        self._serve_thread.join()
        for sock, _ in connections:
            _cut(sock)
        for _, thread in connections:
            thread.join(timeout=5)

    def __enter__(self) -> TestApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def bookmark_interval(self) -> float:
        """Seconds between BOOKMARK events on watches that allow them."""
        return self._bookmark_interval

    @bookmark_interval.setter
    def bookmark_interval(self, seconds: float) -> None:
        with self._cond:
            self._bookmark_interval = seconds
            self._cond.notify_all()  # open watches re-plan their next bookmark

    # --- faults ----------------------------------------------------------

    def drop_watches(self) -> None:
        """Cut every open watch connection mid-stream: no final chunk, as when a
        connection breaks or an apiserver dies."""
        with self._cond:
            self._drop_generation += 1
            for sock in self._watch_sockets:
                _cut(sock)
            self._watch_sockets.clear()
            self._cond.notify_all()

    def expire_history(self) -> None:
        """Forget the retained events (as etcd compaction does): resuming a watch
        from any resourceVersion handed out so far gets 410 Expired. The counter
        moves on by one, so a fresh list gives a version that can be watched."""
        with self._cond:
            self._history.clear()
            self._lost_upto = self._rv
            self._rv += 1
            self._floor = self._rv
            self._snapshots.clear()
            self._cond.notify_all()

    def hang(self, on: bool = True) -> None:
        """While on, connections are accepted and requests read but nothing is sent,
        not even on open watches: a silent network. Requests that hung are closed
        unanswered when it is turned off."""
        with self._cond:
            self._hanging = on
            self._cond.notify_all()

    # --- state -----------------------------------------------------------

    def create(self, obj: dict) -> dict:
        with self._cond:
            kind, key = self._key(obj)
            if key in self._objects[kind.kind]:
                raise ValueError(f'{kind.plural} "{key[1]}" already exists')
            stored = self._store(kind, key, obj, None)
            return copy.deepcopy(stored)

    def update(self, obj: dict) -> dict:
        """Replace an existing object (its resourceVersion, if given, is not checked)."""
        with self._cond:
            kind, key = self._key(obj)
            old = self._objects[kind.kind].get(key)
            if old is None:
                raise KeyError(f'{kind.plural} "{key[1]}" not found')
            return copy.deepcopy(self._store(kind, key, obj, old))

    def apply(self, obj: dict) -> dict:
        """Create the object, or update it if it exists."""
        with self._cond:
            kind, key = self._key(obj)
            old = self._objects[kind.kind].get(key)
            return copy.deepcopy(self._store(kind, key, obj, old))

    def delete(self, kind: str, namespace: str | None, name: str) -> dict:
        with self._cond:
            k = KINDS[kind]
            key = ((namespace or "") if k.namespaced else "", name)
            old = self._objects[kind].pop(key, None)
            if old is None:
                raise KeyError(f'{k.plural} "{name}" not found')
            self._encoded.pop(id(old), None)
            self._rv += 1
            self._record(_Event(self._rv, "DELETED", kind, old, None))
            # The deleted object, as the API returns it, carries the deletion's version.
            return copy.deepcopy(_with_rv(old, self._rv))

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        k = KINDS[kind]
        with self._cond:
            obj = self._objects[kind].get(((namespace or "") if k.namespaced else "", name))
            return copy.deepcopy(obj)

    def objects(self, kind: str) -> list[dict]:
        with self._cond:
            return [copy.deepcopy(o) for _, o in sorted(self._objects[kind].items())]

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._rv)

    def _key(self, obj: dict) -> tuple[_Kind, tuple[str, str]]:
        kind = KINDS.get(obj.get("kind", ""))
        if kind is None:
            raise ValueError(f"unsupported kind {obj.get('kind')!r}")
        meta = obj.get("metadata") or {}
        if not meta.get("name"):
            raise ValueError("metadata.name is required")
        namespace = (meta.get("namespace") or "default") if kind.namespaced else ""
        return kind, (namespace, meta["name"])

    def _store(self, kind: _Kind, key: tuple[str, str], obj: dict, old: dict | None) -> dict:
        self._rv += 1
        new = copy.deepcopy(obj)
        new["kind"], new["apiVersion"] = kind.kind, kind.api_version
        meta = new.setdefault("metadata", {})
        if kind.namespaced:
            meta["namespace"] = key[0]
        else:
            meta.pop("namespace", None)
        if old is None:
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            meta["uid"] = old["metadata"]["uid"]
            meta["creationTimestamp"] = old["metadata"]["creationTimestamp"]
        meta["resourceVersion"] = str(self._rv)
        self._objects[kind.kind][key] = new
        if old is not None:
            self._encoded.pop(id(old), None)
        self._list_item(new)
        self._record(_Event(self._rv, "ADDED" if old is None else "MODIFIED", kind.kind, old, new))
        return new

    def _record(self, event: _Event) -> None:
        if len(self._history) == self._history.maxlen:
            evicted = self._history[0]
            self._lost_upto = evicted.rv
            self._floor = evicted.rv
        self._history.append(event)
        self._cond.notify_all()

    # --- HTTP ------------------------------------------------------------

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(_Handler):
            api = server

        return Handler

    def _route(self, path: str, params: dict[str, str]) -> _Query | None:
        for kind in KINDS.values():
            if not path.startswith(kind.prefix + "/"):
                continue
            rest = path[len(kind.prefix) + 1 :].split("/")
            namespace = None
            if kind.namespaced and len(rest) >= 3 and rest[0] == "namespaces":
                namespace, rest = rest[1], rest[2:]
            if rest[0] != kind.plural or len(rest) > 2 or not all(rest):
                continue
            return _Query(kind, namespace, rest[1] if len(rest) == 2 else None, params)
        return None

    def _get_one(self, q: _Query) -> tuple[int, dict]:
        obj = self.get(q.kind.kind, q.namespace, q.name or "")
        if obj is None:
            msg = f'{q.kind.plural} "{q.name}" not found'
            return 404, {**_status(404, "NotFound", msg), "details": {"name": q.name}}
        return 200, obj

    def _list(self, q: _Query) -> tuple[int, dict | bytes]:
        token = q.params.get("continue")
        with self._cond:
            if token:
                snapshot = self._snapshots.pop(token, None)
                if snapshot is None or snapshot[0] < self._floor:
                    msg = "The provided continue parameter is too old to display a consistent list"
                    return 410, _status(410, "Expired", msg)
                rv, items = snapshot
            else:
                matches = q.matcher()
                rv = self._rv
                items = [
                    self._list_item(o)
                    for _, o in sorted(self._objects[q.kind.kind].items())
                    if matches(o)
                ]
            meta: dict[str, str | int] = {"resourceVersion": str(rv)}
            limit = int(q.params.get("limit") or 0)
            if 0 < limit < len(items):
                # Later pages come from the first page's snapshot: a consistent list.
                items, rest = items[:limit], items[limit:]
                token = uuid.uuid4().hex
                self._snapshots[token] = (rv, rest)
                meta["continue"] = token
                meta["remainingItemCount"] = len(rest)
        head = {"kind": f"{q.kind.kind}List", "apiVersion": q.kind.api_version, "metadata": meta}
        return 200, json.dumps(head)[:-1].encode() + b', "items": [' + b", ".join(items) + b"]}"

    def _list_item(self, obj: dict) -> bytes:
        """`obj` as a list item (without kind and apiVersion), as JSON. (Stored objects
        are never changed in place: a write stores a new one.)"""
        cached = self._encoded.get(id(obj))
        if cached is None or cached[0] is not obj:
            cached = (obj, json.dumps(_without_type_meta(obj)).encode())
            self._encoded[id(obj)] = cached
        return cached[1]


def _cut(sock: socket.socket) -> None:
    """End a connection at once: the peer sees EOF (or an error) mid-response."""
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, as the API serves
    api: TestApiServer

    def setup(self) -> None:
        super().setup()
        # Go's net/http (kube-apiserver) sets TCP_NODELAY; without it a watch event
        # can wait ~40 ms for Nagle and delayed ACKs
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.api._cond:
            if self.api._stopped:
                _cut(self.connection)
            self.api._connections[self.connection] = threading.current_thread()

    def handle(self) -> None:
        with contextlib.suppress(OSError):  # the client went away, or the connection was cut
            super().handle()

    def finish(self) -> None:
        with self.api._cond:
            self.api._connections.pop(self.connection, None)
            self.api._watch_sockets.discard(self.connection)
        with contextlib.suppress(OSError):  # the connection was cut
            super().finish()

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        params = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        api = self.api
        with api._cond:
            api.requests.append(("GET", url.path, params))
            if api._hanging:
                # A silent network: hold the request unanswered until released.
                while api._hanging and not api._stopped:
                    api._cond.wait()
                self.close_connection = True
                return
        q = api._route(url.path, params)
        if q is None:
            self._send_json(
                404, _status(404, "NotFound", "the server could not find the requested resource")
            )
            return
        try:
            if q.name is not None:
                self._send_json(*api._get_one(q))
            elif params.get("watch") in ("1", "true"):
                self._watch(q)
            else:
                self._send_json(*api._list(q))
        except BadRequest as err:
            self._send_json(400, _status(400, "BadRequest", str(err)))

    def _refuse(self) -> None:
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_PUT = do_PATCH = do_DELETE = _refuse  # state changes go through Python

    def _send_json(self, code: int, body: dict | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, events: list[dict]) -> None:
        if events:
            data = b"".join(json.dumps(e).encode() + b"\n" for e in events)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    def _watch(self, q: _Query) -> None:
        api = self.api
        matches = q.matcher()  # before any headers: a bad selector is a plain 400
        rv_param = q.params.get("resourceVersion", "")
        if rv_param not in ("", "0") and not rv_param.isdigit():
            raise BadRequest(f"invalid resource version {rv_param!r}")
        bookmarks = q.params.get("allowWatchBookmarks") in ("1", "true")
        timeout = q.params.get("timeoutSeconds")
        deadline = time.monotonic() + int(timeout) if timeout else None

        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        with api._cond:
            generation = api._drop_generation
            if rv_param in ("", "0"):
                # Like the API: synthetic ADDED events for the current state first.
                first = [
                    {"type": "ADDED", "object": copy.deepcopy(o)}
                    for _, o in sorted(api._objects[q.kind.kind].items())
                    if matches(o)
                ]
                cursor = api._rv
            elif int(rv_param) < api._floor:
                msg = f"too old resource version: {rv_param} ({api._floor})"
                first, cursor = [{"type": "ERROR", "object": _status(410, "Expired", msg)}], -1
            else:
                first, cursor = [], int(rv_param)
            api._watch_sockets.add(self.connection)
        try:
            self._chunk(first)
            if cursor >= 0:
                self._stream(q, matches, cursor, generation, bookmarks, deadline)
            with api._cond:
                if api._drop_generation != generation or api._stopped:
                    return  # cut: no final chunk
                api._watch_sockets.discard(self.connection)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass  # the client went away, or the connection was cut
        finally:
            self.close_connection = True

    def _stream(
        self,
        q: _Query,
        matches: Callable[[dict], bool],
        cursor: int,
        generation: int,
        bookmarks: bool,
        deadline: float | None,
    ) -> None:
        api = self.api
        last_bookmark = time.monotonic()
        while True:
            with api._cond:
                while True:
                    now = time.monotonic()
                    # Read each time: tests may change the interval of open watches.
                    next_bookmark = last_bookmark + api.bookmark_interval
                    if api._drop_generation != generation or api._stopped:
                        return
                    if api._hanging:
                        api._cond.wait()
                        continue
                    if cursor < api._lost_upto:
                        return  # fell behind the history: the API ends such watches
                    events = [e for e in api._history if e.rv > cursor]
                    bookmark_due = bookmarks and now >= next_bookmark
                    timed_out = deadline is not None and now >= deadline
                    if events or bookmark_due or timed_out:
                        break
                    wakeups = [
                        d for d in (next_bookmark if bookmarks else None, deadline) if d is not None
                    ]
                    api._cond.wait(timeout=min(wakeups) - now if wakeups else None)
                cursor = api._rv
                out = [ev for e in events if (ev := _filtered(e, q.kind.kind, matches))]
                if bookmark_due:
                    out.append(_bookmark(q.kind, cursor))
                    last_bookmark = now
            self._chunk(out)
            if timed_out:
                return


def _filtered(e: _Event, kind: str, matches: Callable[[dict], bool]) -> dict | None:
    """The event as a watcher with this selector sees it: an update that moves an
    object into the selection is ADDED, one that moves it out is DELETED (with the
    previous content at the new version), as the API's watch cache does."""
    if e.kind != kind:
        return None
    was = e.old is not None and matches(e.old)
    now = e.new is not None and matches(e.new)
    if was and now:
        return {"type": "MODIFIED", "object": e.new}
    if now:
        return {"type": "ADDED", "object": e.new}
    if was:
        assert e.old is not None
        return {"type": "DELETED", "object": _with_rv(e.old, e.rv)}
    return None


def _bookmark(kind: _Kind, rv: int) -> dict:
    return {
        "type": "BOOKMARK",
        "object": {
            "kind": kind.kind,
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(rv)},
        },
    }
