"""The Kubernetes source: list, then watch Services, EndpointSlices and this Node.

One `Watcher` per (resource, label selector), each a thread running the
list → watch loop of client-go's reflector, on the official client:
  list (remember its resourceVersion) → watch from it, with bookmarks, a
  server-side timeout and a client-side read timeout → a watch that ends
  normally resumes from the last version seen → `410 Gone` lists again →
  any other failure backs off exponentially with jitter and resumes.
Objects are kept as validated model objects in a change tracker
(kpr/sources/tracker.py), so the agent re-translates only the Services that changed.

Requests go through kpr's own connection (kpr/sources/connection.py: credentials and a
urllib3 pool), as the official client's generated list_* operations would make them.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any

import orjson

from kpr.gcpause import paused_gc
from kpr.model import (
    EndpointSlice,
    IPAddress,
    ObjectRef,
    Problem,
    Service,
    Snapshot,
)
from kpr.sources.connection import ApiConnection, ApiError, Timeout, lines
from kpr.sources.objects import (
    SERVICE_PROXY_NAME_LABEL,
    ObjectError,
    node_is_deleting,
)
from kpr.sources.tracker import ChangeTracker
from kpr.sources.wire import (
    decode_service_page,
    decode_slice_page,
    listed_name,
    parse_listed_service,
    parse_listed_slice,
)

log = logging.getLogger(__name__)

HEADLESS_LABEL = "service.kubernetes.io/headless"
LIST_PAGE = 500  # client-go's reflector page size
ZONE_LABEL = "topology.kubernetes.io/zone"


# the list (and watch) operations the agent makes: (the client's name for it, its path)
LIST_SERVICES = ("list_service_for_all_namespaces", "/api/v1/services")
LIST_ENDPOINT_SLICES = (
    "list_endpoint_slice_for_all_namespaces",
    "/apis/discovery.k8s.io/v1/endpointslices",
)
LIST_NODES = ("list_node", "/api/v1/nodes")
# the generated operations' keyword arguments, as query parameters
_QUERY = {
    "label_selector": "labelSelector",
    "field_selector": "fieldSelector",
    "limit": "limit",
    "_continue": "continue",
    "watch": "watch",
    "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
}


def lister(api: ApiConnection, operation: tuple[str, str]) -> Callable[..., Any]:
    """A list_* operation of the official client, with its keyword arguments, as it is
    called with `_preload_content=False`: urllib3's response, or ApiError for a status not
    2xx."""
    name, path = operation

    def call(_request_timeout: Timeout = None, **params: Any) -> Any:
        query = [
            (_QUERY[key], _query_value(value)) for key, value in params.items() if value is not None
        ]
        return api.get(path, query, _request_timeout)

    call.__name__ = name
    return call


def _query_value(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def label_selectors(proxy_name: str) -> list[str]:
    """kube-proxy's selector (no other proxy's label, not headless), and the
    Services that name kpr as their proxy. Label selectors cannot say "or"."""
    return [
        f"!{SERVICE_PROXY_NAME_LABEL},!{HEADLESS_LABEL}",
        f"{SERVICE_PROXY_NAME_LABEL}={proxy_name},!{HEADLESS_LABEL}",
    ]


@dataclass
class Backoff:
    """Exponential back-off with full jitter, reset after a success."""

    initial: float = 0.5
    maximum: float = 30.0
    attempt: int = 0

    def next_delay(self) -> float:
        delay = min(self.maximum, self.initial * 2**self.attempt)
        self.attempt += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0


@dataclass
class WatchStats:
    lists: int = 0
    relists: int = 0  # lists after 410 Gone
    restarts: int = 0  # watches resumed after a failure
    connected: bool = False
    synced: bool = False
    first_list: float | None = None
    last_event: float | None = None
    last_error: str | None = None


class Watcher(threading.Thread):
    """The reflector loop for one resource and selector, feeding `on_list` and `on_event`."""

    def __init__(
        self,
        name: str,
        list_fn: Callable,
        on_list: Callable[[str, Iterable[Any]], None],
        on_event: Callable[[str, str, dict], None],
        stop: threading.Event,
        label_selector: str | None = None,
        field_selector: str | None = None,
        watch_timeout: float = 300.0,
        request_timeout: float = 30.0,
        report: Callable[[str, str], None] = lambda what, resource: None,
        on_connection: Callable[[], None] = lambda: None,
        decode_page: Callable[[bytes], tuple[dict, list]] | None = None,
    ) -> None:
        super().__init__(name=f"watch-{name}", daemon=True)
        # a list page's bytes: (its list metadata, its items, for `on_list`)
        self.decode_page = decode_page or _decode_page
        self.report = report  # ("restart" | "relist", resource) for metrics
        self.on_connection = on_connection  # the watch connected or lost its connection
        self.resource = name
        self.list_fn = list_fn
        self.on_list = on_list
        self.on_event = on_event
        self.stop_event = stop
        self.selectors = {}
        if label_selector:
            self.selectors["label_selector"] = label_selector
        if field_selector:
            self.selectors["field_selector"] = field_selector
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.stats = WatchStats()
        self.backoff = Backoff()
        self._response = None
        self._streaming_since: float | None = None  # when the current watch stream began

    def run(self) -> None:
        version: str | None = None
        while not self.stop_event.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch_from(version)
                self.backoff.reset()
            except ApiError as err:
                self._connected(False)
                if err.status == 410:
                    log.info(
                        "%s: resourceVersion %s expired (410): listing again", self.name, version
                    )
                    self.stats.relists += 1
                    self.report("relist", self.resource.split("-")[0])
                    version = None
                    continue
                self._failed(f"API error {err.status}: {err.reason}")
            except Exception as err:  # network errors, timeouts: the server may come back
                self._connected(False)
                if self._streamed():
                    # a stream that worked and then broke is no sign of a server in trouble:
                    # watch again at once (after the first back-off step), as client-go does
                    self.backoff.reset()
                self._failed(f"{type(err).__name__}: {err}")

    def _connected(self, connected: bool) -> None:
        if connected != self.stats.connected:
            self.stats.connected = connected
            self.on_connection()

    def _streamed(self) -> bool:
        """Did the last watch stream run for a while before it ended? (client-go backs
        off only after a watch that closed within a second.)"""
        since, self._streaming_since = self._streaming_since, None
        return since is not None and time.monotonic() - since >= 1.0

    def _failed(self, reason: str) -> None:
        self.stats.restarts += 1
        self.report("restart", self.resource.split("-")[0])
        self.stats.last_error = reason
        delay = self.backoff.next_delay()
        log.warning("%s: %s; retrying in %.1fs", self.name, reason, delay)
        self.stop_event.wait(delay)

    def _list(self) -> str:
        """List in pages of LIST_PAGE objects, as client-go's reflector does, so a
        large cluster is never held as one JSON document; the list's version."""
        first: dict = {}

        def items() -> Iterator[Any]:
            token = None
            while True:
                extra: dict[str, str] = {"_continue": token} if token else {}
                response = self.list_fn(
                    **self.selectors,
                    limit=LIST_PAGE,
                    _request_timeout=self.request_timeout,
                    **extra,
                )
                with paused_gc():
                    metadata, page = self.decode_page(response.data)
                first.setdefault("resourceVersion", metadata.get("resourceVersion"))
                yield from page
                token = metadata.get("continue")
                if not token:
                    return

        self.on_list(self.resource, items())
        self.stats.lists += 1
        self.stats.synced = True
        self.stats.last_event = time.time()
        self.stats.first_list = self.stats.first_list or self.stats.last_event
        return first["resourceVersion"]

    def _watch_from(self, version: str) -> str:
        """Watch until the server ends the stream; the last version seen. The
        response is read line by line, an event a line."""
        # the server ends the watch after timeout_seconds (jittered, as client-go
        # does); a read that stays silent past that means a dead connection
        timeout = int(self.watch_timeout * random.uniform(1.0, 1.2))
        response = self.list_fn(
            **self.selectors,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout,
            _request_timeout=(self.request_timeout, timeout + self.request_timeout),
        )
        self._response = response
        self._streaming_since = time.monotonic()
        self._connected(True)
        try:
            for line in lines(response):
                if self.stop_event.is_set():
                    break
                if not line.strip():
                    continue
                event = orjson.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":
                    raise ApiError(obj.get("code", 500), obj.get("message", ""))
                version = (obj.get("metadata") or {}).get("resourceVersion", version)
                self.stats.last_event = time.time()
                if kind != "BOOKMARK":
                    self.on_event(self.resource, kind, obj)
        finally:
            self._response = None
            response.release_conn()
        return version

    def close(self) -> None:
        response = self._response
        if response is not None:  # unblock a read waiting on a quiet watch
            with contextlib.suppress(Exception):
                response.shutdown()


@dataclass
class _Store:
    """What the watches brought: the objects (in the change tracker, which knows which
    Services changed), the objects' problems, and what kpr uses of this Node."""

    tracker: ChangeTracker = field(default_factory=ChangeTracker)
    problems: dict[ObjectRef, Problem] = field(default_factory=dict)
    zone: str | None = None
    node_deleting: bool = False
    node_addresses: tuple[IPAddress, ...] = ()  # InternalIPs


class KubernetesSource:
    """Services, EndpointSlices and this Node from the API server."""

    def __init__(
        self,
        api: ApiConnection,
        node_name: str,
        proxy_name: str = "kpr",
        watch_timeout: float = 300.0,
        request_timeout: float = 30.0,
        on_invalid: Callable[[str], None] | None = None,
        report: Callable[[str, str], None] = lambda what, resource: None,
    ) -> None:
        self.api = api
        self.node_name = node_name
        self.description = f"kubernetes:{api.host}"
        self._lock = threading.Lock()
        self._changes = threading.Event()
        self._stop = threading.Event()
        self._store = _Store()
        self._on_invalid = on_invalid or (lambda kind: None)

        def watcher(
            name: str,
            fn: Callable,
            label: str | None = None,
            field: str | None = None,
            decode_page: Callable[[bytes], tuple[dict, list]] | None = None,
        ) -> Watcher:
            return Watcher(
                name,
                fn,
                self._listed,
                self._event,
                self._stop,
                label,
                field,
                watch_timeout=watch_timeout,
                request_timeout=request_timeout,
                report=report,
                on_connection=self.wake,  # `kpr status` shows the watches' health
                decode_page=decode_page,
            )

        self.watchers: list[Watcher] = []
        for i, selector in enumerate(label_selectors(proxy_name)):
            # (list pages decoded into typed structs: kpr/sources/wire.py)
            for name, fn, decode in (
                (f"services-{i}", lister(api, LIST_SERVICES), decode_service_page),
                (f"endpointslices-{i}", lister(api, LIST_ENDPOINT_SLICES), decode_slice_page),
            ):
                self.watchers.append(watcher(name, fn, selector, decode_page=decode))
        self.watchers.append(
            watcher("node", lister(api, LIST_NODES), field=f"metadata.name={node_name}")
        )

    def start(self) -> None:
        for watcher in self.watchers:
            watcher.start()

    def stop(self) -> None:
        self._stop.set()
        for watcher in self.watchers:
            watcher.close()

    @property
    def synced_at(self) -> float | None:
        """When the last of the first lists completed."""
        if not self.synced:
            return None
        return max(w.stats.first_list or 0.0 for w in self.watchers if w.resource != "node")

    @property
    def synced(self) -> bool:
        """Services and EndpointSlices have all been listed once (the Node is optional:
        kpr serves without it, as kube-proxy does)."""
        return all(w.stats.synced for w in self.watchers if w.resource != "node")

    def wait(self, timeout: float) -> bool:
        """Until something changed (True) or `timeout` passed."""
        changed = self._changes.wait(timeout)
        if changed:
            # (only then: a change flagged between a timed-out wait and a clear was lost
            # until the next full sync; changes a tick apart hit that often)
            self._changes.clear()
        return changed

    def wake(self) -> None:
        self._changes.set()

    # --- feeding the store (watcher threads) --------------------------------------

    def _parse(
        self, resource: str, obj: Any, problems: dict[ObjectRef, Problem | None]
    ) -> Service | EndpointSlice | None:
        """The validated object, or None; `problems` gets its problem (or None: fixed)."""
        parse = parse_listed_service if resource.startswith("services") else parse_listed_slice
        ref = _ref(resource, obj)
        try:
            parsed = parse(obj)
        except ObjectError as err:
            # the last good version stays: nothing already programmed is lost
            problems[ref] = Problem(f"{err.message}; skipped", err.ref or ref, err.field)
            self._on_invalid(ref.kind)
            log.warning("invalid %s: %s", ref, err)
            return None
        problems[ref] = None
        return parsed

    def _record(self, problems: dict[ObjectRef, Problem | None]) -> None:
        for ref, problem in problems.items():
            if problem is None:
                self._store.problems.pop(ref, None)
            else:
                self._store.problems[ref] = problem

    def _listed(self, resource: str, items: Iterable[Any]) -> None:
        """A complete list: the table is replaced at once, after every page arrived
        (a list cut short leaves the previous table in place)."""
        if resource == "node":
            nodes = list(items)
            with self._lock:
                changed = self._node(nodes[0] if nodes else None)
            if changed:
                self._changes.set()
            return
        fresh: dict[ObjectRef, Service | EndpointSlice] = {}
        problems: dict[ObjectRef, Problem | None] = {}
        with paused_gc():
            for obj in items:  # pages are fetched while this loop runs
                ref = _ref(resource, obj)
                parsed = self._parse(resource, obj, problems)
                if parsed is not None:
                    fresh[ref] = parsed
        with self._lock, paused_gc():
            tracker = self._store.tracker
            table = tracker.objects(resource)
            for ref, problem in problems.items():
                if problem is not None and ref in table:
                    fresh[ref] = table[ref]  # keep the last good version
            tracker.replace(resource, fresh)
            self._record(problems)
        self._changes.set()

    def _event(self, resource: str, kind: str, obj: dict) -> None:
        with self._lock:
            if resource == "node":
                # kubelet heartbeats update the Node every few seconds: only a change
                # of what kpr uses (zone, being deleted) is worth a full sync
                if not self._node(None if kind == "DELETED" else obj):
                    return
            else:
                ref = _ref(resource, obj)
                if kind == "DELETED":
                    self._store.tracker.delete(ref, resource)
                    self._store.problems.pop(ref, None)
                else:
                    problems: dict[ObjectRef, Problem | None] = {}
                    parsed = self._parse(resource, obj, problems)
                    self._record(problems)
                    if parsed is None:
                        return
                    self._store.tracker.upsert(parsed, resource)
        self._changes.set()

    def _node(self, obj: dict | None) -> bool:
        """Take what kpr uses from this Node; whether any of it changed (then all of
        the state is translated again: topology hints depend on the zone, the devices
        of `--devices auto` on the InternalIPs)."""
        metadata = (obj or {}).get("metadata") or {}
        zone = (metadata.get("labels") or {}).get(ZONE_LABEL)
        deleting = obj is not None and node_is_deleting(obj)
        addresses = internal_ips(obj)
        store = self._store
        if (zone, deleting, addresses) == (store.zone, store.node_deleting, store.node_addresses):
            return False
        store.zone, store.node_deleting, store.node_addresses = zone, deleting, addresses
        store.tracker.resync()
        return True

    # --- the agent's side ----------------------------------------------------------

    def poll(self) -> Snapshot | None:
        """What changed since the last poll; None before the first full list or
        when nothing changed."""
        with self._lock:
            store = self._store
            if not self.synced:
                return None
            changes = store.tracker.take()
            if changes is None:
                return None
            return Snapshot(
                services=changes.services,
                slices=changes.slices,
                problems=list(store.problems.values()),
                changed=changes.changed,
                zone=store.zone,
                node_deleting=store.node_deleting,
                node_addresses=store.node_addresses,
            )

    def resync(self) -> None:
        with self._lock:
            self._store.tracker.resync()
        self._changes.set()

    def pending(self) -> tuple[int, int]:
        """Services with changes not yet polled, and EndpointSlice changes among them
        (not told apart: both count the Services they touch)."""
        with self._lock:
            count = self._store.tracker.pending()
        return count, count

    def status(self) -> dict:
        return {
            w.resource: {
                "connected": w.stats.connected,
                "synced": w.stats.synced,
                "lists": w.stats.lists,
                "relists": w.stats.relists,
                "restarts": w.stats.restarts,
                "last_event": w.stats.last_event,
                "last_error": w.stats.last_error,
            }
            for w in self.watchers
        }


def internal_ips(node: dict | None) -> tuple[IPAddress, ...]:
    """A Node's status.addresses of type InternalIP (`--devices auto` takes the devices
    holding them); one that does not parse is left out."""
    out = []
    for entry in ((node or {}).get("status") or {}).get("addresses") or []:
        if isinstance(entry, dict) and entry.get("type") == "InternalIP":
            try:
                out.append(ip_address(str(entry.get("address"))))
            except ValueError:
                continue
    return tuple(out)


def _decode_page(data: bytes) -> tuple[dict, list]:
    body = orjson.loads(data)
    return body.get("metadata") or {}, body.get("items") or []


def _ref(resource: str, obj: Any) -> ObjectRef:
    kind = (
        "Node"
        if resource == "node"
        else "Service"
        if resource.startswith("services")
        else "EndpointSlice"
    )
    namespace, name = listed_name(obj) if not isinstance(obj, dict) else _name(obj)
    return ObjectRef(kind, namespace or "default", name or "?")


def _name(obj: dict) -> tuple[Any, Any]:
    metadata = obj.get("metadata") or {}
    return metadata.get("namespace"), metadata.get("name")
