"""TestApiServer, driven by the real `kubernetes` client as kpr's watch source drives
kube-apiserver. These tests also pin down how the client (kubernetes 37, urllib3 2)
surfaces bookmarks, 410 Expired, cut streams and timeouts, which the watch source
relies on."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from tests.support.apiserver import TestApiServer
from tests.support.kube import endpoint_slice, service

pytestmark = pytest.mark.timeout(30)


def node(name: str, **labels: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def labelled(name: str, namespace: str = "default", **labels: str) -> dict:
    svc = service(name, ["10.96.0.10"], [("http", 80, "TCP")], namespace=namespace)
    svc["metadata"]["labels"] = labels
    return svc


@pytest.fixture
def server() -> Iterator[TestApiServer]:
    with TestApiServer(bookmark_interval=0.2) as srv:
        yield srv


def api_client(server: TestApiServer, retries: object = None) -> client.ApiClient:
    config = client.Configuration(host=server.url)
    config.retries = retries
    return client.ApiClient(config)


@pytest.fixture
def core(server: TestApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(api_client(server))


def events(stream: Iterator[dict], *, bookmarks: bool = False) -> list[tuple[str, str, str]]:
    """(type, name, resourceVersion) of each event, read until the stream ends."""
    return [
        (
            e["type"],
            e["raw_object"]["metadata"].get("name", ""),
            e["raw_object"]["metadata"]["resourceVersion"],
        )
        for e in stream
        if bookmarks or e["type"] != "BOOKMARK"
    ]


def watches(server: TestApiServer) -> list[dict[str, str]]:
    return [q for _, _, q in server.requests if q.get("watch") in ("1", "true")]


def test_list_returns_items_and_the_current_resource_version(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    server.create(labelled("a"))
    server.create(labelled("b", namespace="other"))
    server.create(endpoint_slice("a", ["10.244.0.5"], [("http", 8080, "TCP")]))
    server.create(node("node-1"))

    services = core.list_service_for_all_namespaces()
    assert [s.metadata.name for s in services.items] == ["a", "b"]
    assert services.metadata.resource_version == server.resource_version
    assert [s.metadata.name for s in core.list_namespaced_service("other").items] == ["b"]
    slices = client.DiscoveryV1Api(core.api_client).list_endpoint_slice_for_all_namespaces()
    assert slices.items[0].endpoints[0].addresses == ["10.244.0.5"]
    assert slices.items[0].metadata.labels == {"kubernetes.io/service-name": "a"}
    assert [n.metadata.name for n in core.list_node().items] == ["node-1"]

    got = core.read_namespaced_service("a", "default")
    assert (
        got.metadata.uid
        and got.metadata.resource_version
        == server.get("Service", "default", "a")["metadata"]["resourceVersion"]
    )
    with pytest.raises(ApiException) as err:
        core.read_namespaced_service("missing", "default")
    assert err.value.status == 404

    # On the wire, list items lack kind/apiVersion, as the real API sends them.
    raw = json.loads(core.list_service_for_all_namespaces(_preload_content=False).data)
    assert raw["kind"] == "ServiceList" and raw["apiVersion"] == "v1"
    assert "kind" not in raw["items"][0] and "apiVersion" not in raw["items"][0]


def test_every_change_bumps_one_global_resource_version(server: TestApiServer) -> None:
    created = server.create(labelled("a"))
    first = created["metadata"]["resourceVersion"]
    server.create(node("n"))  # another kind: the same counter
    updated = server.update(labelled("a", app="x"))
    assert int(updated["metadata"]["resourceVersion"]) == int(first) + 2
    for field in ("uid", "creationTimestamp"):  # kept across updates
        assert updated["metadata"][field] == created["metadata"][field]
    deleted = server.delete("Service", "default", "a")
    assert int(deleted["metadata"]["resourceVersion"]) == int(first) + 3
    assert server.resource_version == deleted["metadata"]["resourceVersion"]
    assert server.objects("Service") == []
    with pytest.raises(KeyError):
        server.update(labelled("a"))
    server.apply(labelled("a"))
    with pytest.raises(ValueError):
        server.create(labelled("a"))


def test_watch_from_a_list_version_sees_changes_in_order(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    server.create(labelled("a"))
    rv = core.list_service_for_all_namespaces().metadata.resource_version
    server.create(labelled("b"))
    server.update(labelled("a", app="x"))
    server.delete("Service", "default", "b")
    server.create(node("n"))  # not a Service: not in this watch

    got = events(
        watch.Watch().stream(
            core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=1
        )
    )
    assert [(t, n) for t, n, _ in got] == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    versions = [int(v) for _, _, v in got]
    assert versions == sorted(versions) and versions[0] > int(rv)


def test_watch_sees_changes_made_while_it_is_open(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    w = watch.Watch()
    seen = []
    stream = w.stream(
        core.list_namespaced_service,
        "default",
        resource_version=server.resource_version,
        allow_watch_bookmarks=True,
        timeout_seconds=10,
    )
    for e in stream:
        if e["type"] == "BOOKMARK" and not seen:
            server.create(labelled("a"))
            server.create(labelled("a", namespace="other"))  # another namespace: unseen
            server.delete("Service", "default", "a")
        elif e["type"] != "BOOKMARK":
            seen.append((e["type"], e["object"].metadata.name))
            if len(seen) == 2:
                w.stop()
    assert seen == [("ADDED", "a"), ("DELETED", "a")]


def test_watch_without_a_version_starts_with_the_current_state(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    server.create(labelled("a"))
    server.create(labelled("b"))
    for rv in ("0", None):
        kwargs = {"resource_version": rv} if rv is not None else {}
        got = events(
            watch.Watch().stream(core.list_service_for_all_namespaces, timeout_seconds=1, **kwargs)
        )
        assert [(t, n) for t, n, _ in got] == [("ADDED", "a"), ("ADDED", "b")]


def test_timeout_seconds_ends_the_stream_cleanly(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    start = time.monotonic()
    # With timeout_seconds the client does not re-watch: the generator just ends.
    assert (
        events(
            watch.Watch().stream(
                core.list_node, resource_version=server.resource_version, timeout_seconds=1
            )
        )
        == []
    )
    assert 0.9 < time.monotonic() - start < 3
    assert len(watches(server)) == 1


def test_bookmarks_are_yielded_and_move_the_watch_version(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    """kubernetes 37's Watch.stream yields BOOKMARK events (object left as the raw
    dict, not a model) and sets Watch.resource_version from them, so a re-watch after
    a clean end resumes from the bookmark."""
    rv = server.resource_version
    w = watch.Watch()
    for e in w.stream(
        core.list_service_for_all_namespaces,
        resource_version=rv,
        allow_watch_bookmarks=True,
        timeout_seconds=10,
    ):
        assert e["type"] == "BOOKMARK"
        assert e["object"] == {
            "kind": "Service",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": e["object"]["metadata"]["resourceVersion"]},
        }
        if e["object"]["metadata"]["resourceVersion"] == rv:
            # Changes to other kinds still move a Service watcher's bookmarks on.
            server.create(node("n"))
        else:
            assert e["object"]["metadata"]["resourceVersion"] == server.resource_version
            assert w.resource_version == server.resource_version
            w.stop()


def test_no_bookmarks_unless_asked(server: TestApiServer, core: client.CoreV1Api) -> None:
    got = events(
        watch.Watch().stream(
            core.list_node, resource_version=server.resource_version, timeout_seconds=1
        ),
        bookmarks=True,
    )
    assert got == []


def test_raw_stream_is_chunked_json_lines(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.create(labelled("a"))
    resp = core.list_service_for_all_namespaces(
        watch=True,
        resource_version="0",
        allow_watch_bookmarks=True,
        timeout_seconds=1,
        _preload_content=False,
    )
    assert resp.status == 200 and resp.headers["Transfer-Encoding"] == "chunked"
    lines = [json.loads(line) for line in b"".join(resp.stream()).splitlines()]
    assert lines[0]["type"] == "ADDED"
    assert lines[0]["object"]["kind"] == "Service" and lines[0]["object"]["apiVersion"] == "v1"
    assert {e["type"] for e in lines[1:]} == {"BOOKMARK"}


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        # kube-proxy's own selector: no headless Services, none for another proxy.
        ("!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name", ["plain"]),
        ("service.kubernetes.io/service-proxy-name in (kpr, other)", ["kpr", "other"]),
        ("service.kubernetes.io/service-proxy-name notin (kpr)", ["headless", "other", "plain"]),
        ("service.kubernetes.io/service-proxy-name=kpr", ["kpr"]),
        ("service.kubernetes.io/service-proxy-name==kpr", ["kpr"]),
        ("service.kubernetes.io/service-proxy-name!=kpr", ["headless", "other", "plain"]),
        ("service.kubernetes.io/headless", ["headless"]),
        ("app=web,!service.kubernetes.io/headless", ["plain"]),
        ("", ["headless", "kpr", "other", "plain"]),
    ],
)
def test_label_selectors_filter_lists(
    server: TestApiServer, core: client.CoreV1Api, selector: str, names: list[str]
) -> None:
    server.create(labelled("plain", app="web"))
    server.create(labelled("headless", app="web", **{"service.kubernetes.io/headless": ""}))
    server.create(labelled("kpr", **{"service.kubernetes.io/service-proxy-name": "kpr"}))
    server.create(labelled("other", **{"service.kubernetes.io/service-proxy-name": "other"}))
    got = core.list_service_for_all_namespaces(label_selector=selector)
    assert sorted(s.metadata.name for s in got.items) == names


def test_bad_selectors_are_400(core: client.CoreV1Api) -> None:
    for kwargs in ({"label_selector": "a in (x"}, {"field_selector": "spec.type=ClusterIP"}):
        with pytest.raises(ApiException) as err:
            core.list_service_for_all_namespaces(**kwargs)
        assert err.value.status == 400
        with pytest.raises(ApiException) as err:
            list(
                watch.Watch().stream(
                    core.list_service_for_all_namespaces, timeout_seconds=1, **kwargs
                )
            )
        assert err.value.status == 400


def test_watch_sends_moves_across_a_selector_as_added_and_deleted(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    server.create(labelled("a"))
    rv = server.resource_version
    server.update(labelled("a", **{"service.kubernetes.io/headless": ""}))  # leaves
    server.update(labelled("a", **{"service.kubernetes.io/headless": "", "x": "1"}))  # unseen
    server.update(labelled("a"))  # comes back
    server.update(labelled("a", x="2"))
    stream = watch.Watch().stream(
        core.list_service_for_all_namespaces,
        label_selector="!service.kubernetes.io/headless",
        resource_version=rv,
        timeout_seconds=1,
    )
    got = [(e["type"], e["raw_object"]) for e in stream]
    assert [t for t, _ in got] == ["DELETED", "ADDED", "MODIFIED"]
    # DELETED carries the last content that matched, at the version of the change.
    assert got[0][1]["metadata"].get("labels") == {}
    assert int(got[0][1]["metadata"]["resourceVersion"]) == int(rv) + 1


def test_field_selector_on_node_name(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.create(node("node-1"))
    server.create(node("node-2"))
    got = core.list_node(field_selector="metadata.name=node-2")
    assert [n.metadata.name for n in got.items] == ["node-2"]
    rv = got.metadata.resource_version
    server.update(node("node-1", zone="a"))
    server.update(node("node-2", zone="b"))
    got_events = events(
        watch.Watch().stream(
            core.list_node,
            field_selector="metadata.name=node-2",
            resource_version=rv,
            timeout_seconds=1,
        )
    )
    assert [(t, n) for t, n, _ in got_events] == [("MODIFIED", "node-2")]
    assert core.read_node("node-1").metadata.labels == {"zone": "a"}


def test_limit_and_continue_give_a_consistent_snapshot(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    for name in "abcde":
        server.create(labelled(name))
    first = core.list_service_for_all_namespaces(limit=2)
    assert [s.metadata.name for s in first.items] == ["a", "b"]
    server.delete("Service", "default", "e")  # after the first page: not seen by the rest
    names = []
    token = first.metadata._continue
    while token:
        page = core.list_service_for_all_namespaces(limit=2, _continue=token)
        assert page.metadata.resource_version == first.metadata.resource_version
        names += [s.metadata.name for s in page.items]
        token = page.metadata._continue
    assert names == ["c", "d", "e"]


def test_too_old_version_raises_410(server: TestApiServer, core: client.CoreV1Api) -> None:
    """The server answers 200 with one ERROR event (a Status, code 410); Watch.stream
    turns that into ApiException(status=410, reason="Expired: too old resource
    version: ..."). With timeout_seconds it raises at once; without it, it first
    re-watches once from the same version (so two watch requests), then raises."""
    with pytest.raises(ApiException) as err:
        list(
            watch.Watch().stream(
                core.list_service_for_all_namespaces, resource_version="1", timeout_seconds=5
            )
        )
    assert err.value.status == 410 and err.value.reason.startswith(
        "Expired: too old resource version: 1"
    )
    assert len(watches(server)) == 1

    with pytest.raises(ApiException) as err:
        list(watch.Watch().stream(core.list_service_for_all_namespaces, resource_version="1"))
    assert err.value.status == 410
    assert len(watches(server)) == 3

    resp = core.list_service_for_all_namespaces(
        watch=True, resource_version="1", _preload_content=False
    )
    assert resp.status == 200
    (line,) = b"".join(resp.stream()).splitlines()
    event = json.loads(line)
    assert event["type"] == "ERROR"
    assert event["object"]["code"] == 410 and event["object"]["reason"] == "Expired"


def test_expire_history_forces_a_relist(server: TestApiServer, core: client.CoreV1Api) -> None:
    server.create(labelled("a"))
    old = core.list_service_for_all_namespaces().metadata.resource_version
    server.expire_history()
    with pytest.raises(ApiException) as err:
        list(
            watch.Watch().stream(
                core.list_service_for_all_namespaces, resource_version=old, timeout_seconds=1
            )
        )
    assert err.value.status == 410
    # A fresh list hands out a version that can be watched from.
    fresh = core.list_service_for_all_namespaces().metadata.resource_version
    server.update(labelled("a", x="1"))
    got = events(
        watch.Watch().stream(
            core.list_service_for_all_namespaces, resource_version=fresh, timeout_seconds=1
        )
    )
    assert [(t, n) for t, n, _ in got] == [("MODIFIED", "a")]


def test_bounded_history_expires_old_versions() -> None:
    with TestApiServer(history_size=3) as server:
        core = client.CoreV1Api(api_client(server))
        server.create(labelled("a"))
        rv = server.resource_version
        for i in range(3):
            server.update(labelled("a", n=str(i)))
        got = events(
            watch.Watch().stream(
                core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=1
            )
        )
        assert [t for t, _, _ in got] == ["MODIFIED"] * 3  # exactly the retained events
        server.update(labelled("a", n="last"))
        with pytest.raises(ApiException) as err:
            list(
                watch.Watch().stream(
                    core.list_service_for_all_namespaces, resource_version=rv, timeout_seconds=1
                )
            )
        assert err.value.status == 410


def test_a_watch_that_falls_behind_the_history_is_ended() -> None:
    """As the API ends a watcher that lags behind its history: the stream ends cleanly,
    and resuming from the last version seen gets 410."""
    with TestApiServer(history_size=2, bookmark_interval=0.1) as server:
        core = client.CoreV1Api(api_client(server))
        server.create(labelled("a"))
        w = watch.Watch()
        got = []
        for e in w.stream(
            core.list_service_for_all_namespaces,
            resource_version=server.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=10,
        ):
            got.append(e["type"])
            if len(got) == 1:
                server.hang(True)  # holds the watcher back while three events pass
                for i in range(3):
                    server.update(labelled("a", n=str(i)))
                server.hang(False)
        assert got == ["BOOKMARK"]
        with pytest.raises(ApiException) as err:
            list(
                w.stream(
                    core.list_service_for_all_namespaces,
                    resource_version=w.resource_version,
                    timeout_seconds=1,
                )
            )
        assert err.value.status == 410


def test_drop_watches_cuts_streams(server: TestApiServer, core: client.CoreV1Api) -> None:
    """A cut stream (no final chunk) surfaces as urllib3.exceptions.ProtocolError
    ("Response ended prematurely"), straight out of Watch.stream."""
    server.create(labelled("a"))
    stream = watch.Watch().stream(
        core.list_service_for_all_namespaces, resource_version="0", timeout_seconds=10
    )
    with pytest.raises(urllib3.exceptions.ProtocolError):
        for _ in stream:
            server.drop_watches()
    # The server itself is fine: lists and new watches work.
    assert len(core.list_service_for_all_namespaces().items) == 1
    assert len(events(watch.Watch().stream(core.list_node, timeout_seconds=1))) == 0


def test_stop_refuses_and_start_serves_again_on_the_same_port(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    """Connection refused surfaces as urllib3.exceptions.MaxRetryError whose reason is
    a NewConnectionError (urllib3 retries 3 times first, instantly)."""
    server.create(labelled("a"))
    url = server.url
    stream = watch.Watch().stream(
        core.list_service_for_all_namespaces, resource_version="0", timeout_seconds=10
    )
    with pytest.raises(urllib3.exceptions.ProtocolError):
        for _ in stream:
            server.stop()  # an open watch is cut, too
    with pytest.raises(urllib3.exceptions.MaxRetryError) as err:
        core.list_service_for_all_namespaces()
    assert isinstance(err.value.reason, urllib3.exceptions.NewConnectionError)

    server.start()
    assert server.url == url
    assert [s.metadata.name for s in core.list_service_for_all_namespaces().items] == ["a"]


def test_stop_does_not_wait_for_open_requests(
    server: TestApiServer, core: client.CoreV1Api
) -> None:
    failures: list[Exception] = []

    def run(fn: Callable[[], object]) -> threading.Thread:
        def target() -> None:
            try:
                fn()
            except Exception as err:  # the point: each call fails once the server stops
                failures.append(err)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    watcher = run(lambda: list(watch.Watch().stream(core.list_node, timeout_seconds=30)))
    time.sleep(0.2)
    server.hang(True)
    hung = run(core.list_node)
    time.sleep(0.3)
    start = time.monotonic()
    server.stop()
    assert time.monotonic() - start < 2
    watcher.join(5)
    hung.join(5)
    assert not watcher.is_alive() and not hung.is_alive()
    assert len(failures) == 2


def test_hang_makes_requests_time_out(server: TestApiServer) -> None:
    """A silent server with _request_timeout=1 raises urllib3.exceptions.ReadTimeoutError
    after 1 s when the client's Configuration.retries is False. With the default retries
    (None: urllib3's Retry(3), which retries read timeouts on GET) it is MaxRetryError
    with a ReadTimeoutError reason, after 4 x the timeout."""
    core = client.CoreV1Api(api_client(server, retries=False))
    server.hang(True)
    start = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        core.list_service_for_all_namespaces(_request_timeout=1)
    assert 0.9 < time.monotonic() - start < 2.5
    server.hang(False)
    assert core.list_service_for_all_namespaces(_request_timeout=1).items == []


def test_hang_mid_stream_times_the_watch_out(server: TestApiServer) -> None:
    """_request_timeout on a watch is a read timeout between chunks, so bookmarks keep
    a quiet watch alive and a silent server ends it with ReadTimeoutError."""
    core = client.CoreV1Api(api_client(server, retries=False))
    got = []
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        for e in watch.Watch().stream(
            core.list_service_for_all_namespaces,
            resource_version=server.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=20,
            _request_timeout=1,
        ):
            got.append(e["type"])
            if len(got) == 6:  # 1.2 s of bookmarks: longer than the read timeout
                server.hang(True)
    assert got == ["BOOKMARK"] * 6
    server.hang(False)


def test_requests_are_recorded(server: TestApiServer, core: client.CoreV1Api) -> None:
    core.list_namespaced_service("default", label_selector="a=b")
    assert server.requests == [
        ("GET", "/api/v1/namespaces/default/services", {"labelSelector": "a=b"})
    ]
