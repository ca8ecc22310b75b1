"""The Kubernetes source's handling of this Node, fed as its watchers feed it (no server)."""

from __future__ import annotations

import pytest

from kpr.sources.connection import connect
from kpr.sources.kubernetes import LIST_SERVICES, KubernetesSource, lister
from tests.support.kube import endpoint_slice, service


def node(rv: str, zone: str | None = "zone-a", **extra: object) -> dict:
    metadata: dict = {"name": "node-1", "resourceVersion": rv}
    if zone:
        metadata["labels"] = {"topology.kubernetes.io/zone": zone}
    metadata.update(extra.pop("metadata", {}))
    return {"apiVersion": "v1", "kind": "Node", "metadata": metadata, **extra}


def heartbeat(rv: str, **extra: object) -> dict:
    """What a kubelet writes every few seconds: new conditions' times, nothing kpr uses."""
    return node(
        rv,
        status={"conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": rv}]},
        **extra,
    )


FIRST_SLICE = endpoint_slice("web", [], [])["metadata"]["name"]  # the fixture's


@pytest.fixture
def source() -> KubernetesSource:
    source = KubernetesSource(connect(None, "http://127.0.0.1:1"), "node-1")
    for watcher in source.watchers:  # as if every first list had completed
        watcher.stats.synced = True
    source._listed("services-0", [service("web", ["10.96.0.10"], [("http", 80, "TCP")])])
    source._listed(
        "endpointslices-0", [endpoint_slice("web", ["10.244.0.5"], [("http", 8080, "TCP")])]
    )
    source._listed("node", [node("1")])
    assert source.wait(0)
    first = source.poll()
    assert first is not None and first.changed is None and first.zone == "zone-a"
    return source


def test_a_node_heartbeat_does_not_trigger_a_resync(source: KubernetesSource) -> None:
    source._event("node", "MODIFIED", heartbeat("2"))
    source._event("node", "MODIFIED", heartbeat("3"))
    assert not source.wait(0)
    assert source.poll() is None


def test_a_zone_change_triggers_a_full_resync(source: KubernetesSource) -> None:
    source._event("node", "MODIFIED", node("2", zone="zone-b"))
    assert source.wait(0)
    snapshot = source.poll()
    assert snapshot is not None and snapshot.changed is None and snapshot.zone == "zone-b"


def test_a_relist_of_an_unchanged_node_does_not_resync(source: KubernetesSource) -> None:
    source._listed("node", [heartbeat("9")])
    assert source.poll() is None


@pytest.mark.parametrize(
    "draining",
    [
        {"spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}},
        {"metadata": {"deletionTimestamp": "2026-12-01T10:00:00Z"}},
    ],
    ids=["autoscaler-taint", "deletion-timestamp"],
)
def test_a_draining_node_is_reported_as_deleting(source: KubernetesSource, draining: dict) -> None:
    source._event("node", "MODIFIED", node("2", **draining))
    snapshot = source.poll()
    assert snapshot is not None and snapshot.node_deleting
    # and back: the autoscaler removes its taint when it gives up scaling down
    source._event("node", "MODIFIED", node("3"))
    snapshot = source.poll()
    assert snapshot is not None and not snapshot.node_deleting


def test_other_taints_do_not_drain(source: KubernetesSource) -> None:
    tainted = node("2", spec={"taints": [{"key": "node.kubernetes.io/unschedulable"}]})
    source._event("node", "MODIFIED", tainted)
    assert source.poll() is None


def test_in_cluster_credentials_send_the_pod_token_to_master(tmp_path, monkeypatch):
    """In a pod (the DaemonSet) with --master set, every request goes to --master with the
    pod's token: not to the kubernetes Service's ClusterIP (nothing serves it until kpr
    runs: found on the real-node lab)."""
    from kpr.sources import connection
    from tests.support.apiserver import TestApiServer

    (tmp_path / "token").write_text("pod-token\n")
    # a CA certificate the ssl module accepts (the test server is plain HTTP)
    (tmp_path / "ca.crt").write_text(ssl_ca_pem())
    monkeypatch.setattr(connection, "SERVICE_ACCOUNT", tmp_path)
    # What the kubelet gives every pod: the kubernetes Service, here an address nothing serves.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "1")
    with TestApiServer() as server:
        api = connect(None, server.url)
        for _ in range(3):
            assert b"items" in lister(api, LIST_SERVICES)(_request_timeout=5).data
        assert api.host == server.url and api.token() == "pod-token"
        assert connect(None, None).host == "https://127.0.0.1:1"


def ssl_ca_pem() -> str:
    """Some CA certificate in PEM: the system's first."""
    import ssl

    paths = ssl.get_default_verify_paths()
    with open(paths.cafile or "/etc/ssl/certs/ca-certificates.crt") as f:
        text = f.read()
    end = "-----END CERTIFICATE-----"
    return text[: text.index(end) + len(end)] + "\n"


def test_the_nodes_internal_ips_come_with_the_snapshot_and_a_change_resyncs(
    source: KubernetesSource,
) -> None:
    addresses = [
        {"type": "Hostname", "address": "node-1"},
        {"type": "InternalIP", "address": "192.168.50.1"},
        {"type": "ExternalIP", "address": "203.0.113.1"},
        {"type": "InternalIP", "address": "fd00:50::1"},
    ]
    source._event("node", "MODIFIED", node("2", status={"addresses": addresses}))
    assert source.wait(0)
    snapshot = source.poll()
    assert snapshot is not None and snapshot.changed is None
    assert [str(a) for a in snapshot.node_addresses] == ["192.168.50.1", "fd00:50::1"]
    source._event("node", "MODIFIED", node("3", status={"addresses": addresses}))
    assert source.poll() is None  # the same addresses: nothing to do


def test_resync_makes_the_next_poll_return_everything(source: KubernetesSource) -> None:
    assert source.poll() is None
    source.resync()
    assert source.wait(0)
    snapshot = source.poll()
    assert snapshot is not None and snapshot.changed is None and len(snapshot.services) == 1


def test_a_slice_event_hands_over_its_service_alone_with_all_of_its_slices(
    source: KubernetesSource,
) -> None:
    db = service("db", ["10.96.0.11"], [("http", 80, "TCP")])
    source._event("services-0", "ADDED", db)
    assert source.pending() == (1, 1)
    change = source.poll()
    assert change is not None and change.changed == {("default", "db")}
    assert [s.name for s in change.services] == ["db"] and change.slices == []
    second = endpoint_slice("web", ["10.244.0.6"], [("http", 8080, "TCP")], name="web-2")
    source._event("endpointslices-0", "ADDED", second)
    change = source.poll()
    assert change is not None and change.changed == {("default", "web")}
    assert [s.name for s in change.services] == ["web"]
    assert sorted(s.name for s in change.slices) == sorted([FIRST_SLICE, "web-2"])
    assert source.poll() is None


def test_a_service_the_second_watch_adds_before_the_first_deletes_it_is_kept(
    source: KubernetesSource,
) -> None:
    """Relabelled to name kpr as its proxy, it moves from one label selector's watch to the
    other's: events of two watches come in no set order."""
    web = service("web", ["10.96.0.10"], [("http", 80, "TCP")])
    source._event("services-1", "ADDED", web)
    source._event("services-0", "DELETED", web)
    change = source.poll()
    assert change is not None and [s.name for s in change.services] == ["web"]
    assert [s.name for s in change.slices] == [FIRST_SLICE]


def test_a_change_flagged_as_a_wait_times_out_wakes_the_next_wait(source, monkeypatch):
    """The race: a watcher flags a change just after the agent's wait gave up. It must wake
    the next wait at once, not wait for the next full sync (30 s)."""
    changes = source._changes
    timed_out_wait = changes.wait

    def wait_that_times_out_as_a_change_arrives(timeout):
        timed_out_wait(0)
        source._event(
            "endpointslices-0",
            "MODIFIED",
            endpoint_slice("web", ["10.244.0.6"], [("http", 8080, "TCP")]),
        )
        return False

    monkeypatch.setattr(changes, "wait", wait_that_times_out_as_a_change_arrives)
    assert source.wait(1.0) is False
    monkeypatch.undo()
    assert source.wait(0) is True
    assert source.poll() is not None
