"""The desired state kept per Service, and its one conflict rule (kpr/desired/state.py)."""

from __future__ import annotations

import os
from ipaddress import ip_address
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kpr.desired.state import DesiredState, translate
from kpr.model import EndpointSlice, Frontend, ObjectRef, Service, ServicePort, Translation
from kpr.sources.manifests import ManifestSource
from kpr.sources.tracker import ChangeTracker
from tests.support.builders import EXTERNAL_NODE, endpoint, endpoint_slice, service

NODE = EXTERNAL_NODE
VIP = Frontend(ip_address("10.96.0.10"), 80, "TCP")


def claimant(name: str, namespace: str = "default", backend: str = "10.244.1.1") -> tuple:
    """A Service on the shared VIP, and its slice with one backend."""
    return (
        service(name, namespace=namespace),
        endpoint_slice(endpoint(backend), name=f"{name}-1", service_name=name, namespace=namespace),
    )


def fold(state: DesiredState, *objects: Service | EndpointSlice) -> set[Frontend] | None:
    """A partial update naming the Services of these objects."""
    changed = {(o.namespace, o.name if isinstance(o, Service) else o.service_name) for o in objects}
    services = [o for o in objects if isinstance(o, Service)]
    slices = [o for o in objects if isinstance(o, EndpointSlice)]
    return state.update(services, slices, NODE, changed)  # type: ignore[arg-type]


def gone(state: DesiredState, name: str, namespace: str = "default") -> set[Frontend] | None:
    """A partial update: the Service and its slices were deleted."""
    return state.update([], [], NODE, {(namespace, name)})


def assert_same(partial: Translation, whole: Translation) -> None:
    assert partial.frontends == whole.frontends
    assert partial.held == whole.held
    assert partial.owners == whole.owners
    assert [str(p) for p in partial.problems] == [str(p) for p in whole.problems]
    assert partial.health_checks == whole.health_checks
    assert partial.no_local_endpoints == whole.no_local_endpoints
    assert partial.local_endpoints == whole.local_endpoints


def test_the_first_by_namespace_and_name_keeps_a_contested_frontend_whichever_came_first():
    alpha, beta = claimant("alpha", backend="10.244.1.1"), claimant("beta", backend="10.244.1.2")
    for first, second in ((alpha, beta), (beta, alpha)):
        state = DesiredState()
        fold(state, *first)
        fold(state, *second)
        assert state.translation.frontends[VIP].service == "default/alpha:http"
        assert state.translation.owners[VIP] == ("default", "alpha")
        (problem,) = state.translation.problems
        assert problem.ref == ObjectRef("Service", "default", "beta")
        assert str(problem) == (
            "Service default/beta: spec.ports[0]: 10.96.0.10:80/TCP is also claimed by "
            "Service default/alpha, which keeps it"
        )
        whole = translate([alpha[0], beta[0]], [alpha[1], beta[1]], NODE)
        assert_same(state.translation, whole)


def test_when_the_keeper_goes_the_next_claimant_takes_the_frontend_over():
    state = DesiredState()
    for name, backend in (("a", "10.244.1.1"), ("b", "10.244.1.2"), ("c", "10.244.1.3")):
        fold(state, *claimant(name, backend=backend))
    assert len(state.translation.problems) == 2
    touched = gone(state, "a")
    assert touched == {VIP}
    assert state.translation.frontends[VIP].service == "default/b:http"
    assert [str(b) for b in state.translation.frontends[VIP].backends] == ["10.244.1.2:8080"]
    (problem,) = state.translation.problems
    assert problem.ref.name == "c" and "Service default/b, which keeps it" in problem.message
    gone(state, "b")
    assert state.translation.owners == {VIP: ("default", "c")}
    assert state.translation.problems == []
    gone(state, "c")
    assert state.translation.frontends == {} and state.translation.owners == {}


def test_a_loser_that_changes_does_not_take_the_frontend_nor_repeat_its_problem():
    state = DesiredState()
    fold(state, *claimant("a"))
    for backend in ("10.244.1.7", "10.244.1.8", "10.244.1.9"):
        fold(state, *claimant("b", backend=backend))
    assert state.translation.frontends[VIP].service == "default/a:http"
    claims = [p for p in state.translation.problems if "also claimed" in p.message]
    assert len(claims) == 1 and claims[0].ref.name == "b"


def test_a_partial_update_touches_only_the_frontends_of_the_services_it_names():
    state = DesiredState()
    web = service("web", cluster_ips=("10.96.0.1",))
    db = service("db", cluster_ips=("10.96.0.2",))
    assert state.update([web, db], [], NODE) is None  # the whole state: all touched
    slice_ = endpoint_slice(endpoint("10.244.1.1"), name="web-1", service_name="web")
    assert fold(state, web, slice_) == {Frontend(ip_address("10.96.0.1"), 80, "TCP")}
    assert [str(b) for b in state.translation.frontends[Frontend(
        ip_address("10.96.0.1"), 80, "TCP")].backends] == ["10.244.1.1:8080"]  # fmt: skip


def test_a_slice_naming_a_missing_service_is_a_problem_until_the_service_comes():
    state = DesiredState()
    orphan = endpoint_slice(endpoint("10.244.1.1"), name="web-1", service_name="web")
    fold(state, orphan)
    (problem,) = state.translation.problems
    assert problem.ref == orphan.ref and "names Service default/web" in problem.message
    fold(state, service("web"), orphan)
    assert state.translation.problems == []
    assert VIP in state.translation.frontends


# --- the same state however it was reached ---------------------------------------------

NAMES = ["a", "b", "c"]
NAMESPACES = ["x", "y"]
SLICES = ["s1", "s2", "s3"]


@st.composite
def services(draw: st.DrawFn) -> Service:
    namespace, name = draw(st.sampled_from(NAMESPACES)), draw(st.sampled_from(NAMES))
    kind = draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]))
    node_port = draw(st.sampled_from([30080, 30081])) if kind != "ClusterIP" else None
    local = draw(st.booleans())
    return service(
        name,
        cluster_ips=(draw(st.sampled_from(["10.96.0.1", "10.96.0.2"])),),
        ports=(ServicePort("http", "TCP", draw(st.sampled_from([80, 80, 443])), node_port),),
        namespace=namespace,
        type=kind,
        external_ips=tuple(
            ip_address(a) for a in draw(st.lists(st.sampled_from(["192.0.2.1", "192.0.2.2"])))
        ),
        load_balancer_ips=(ip_address("198.51.100.1"),) if kind == "LoadBalancer" else (),
        external_traffic_policy="Local" if local else "Cluster",
        health_check_node_port=32000 if local and kind != "ClusterIP" else None,
    )


@st.composite
def slices(draw: st.DrawFn) -> EndpointSlice:
    namespace = draw(st.sampled_from(NAMESPACES))
    endpoints = [
        endpoint(f"10.244.0.{n}", node_name=draw(st.sampled_from(["node-1", "node-2"])))
        for n in draw(st.sets(st.integers(1, 4), max_size=3))
    ]
    return endpoint_slice(
        *endpoints,
        name=draw(st.sampled_from(SLICES)),
        service_name=draw(st.sampled_from([*NAMES, None])),
        namespace=namespace,
    )


# an object added or changed, or deleted (its ref); and whether the changes are taken then
operations = st.lists(
    st.tuples(
        st.one_of(
            services(),
            slices(),
            st.builds(ObjectRef, st.just("Service"), *map(st.sampled_from, (NAMESPACES, NAMES))),
            st.builds(
                ObjectRef, st.just("EndpointSlice"), *map(st.sampled_from, (NAMESPACES, SLICES))
            ),
        ),
        st.booleans(),
    ),
    max_size=30,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(operations)
def test_partial_updates_in_any_order_reach_what_a_full_translation_gives(ops) -> None:
    """Objects come and go through the change tracker, the store takes what changed at
    random moments; at the end it holds what one translation of the objects gives: the
    same winner of every contested frontend, the same problems."""
    tracker, state = ChangeTracker(), DesiredState()
    for op, take in ops:
        if isinstance(op, ObjectRef):
            tracker.delete(op)
        else:
            tracker.upsert(op)
        changes = tracker.take() if take else None
        if changes is not None:
            state.update(changes.services, changes.slices, NODE, changes.changed)
    changes = tracker.take()
    if changes is not None:
        state.update(changes.services, changes.slices, NODE, changes.changed)
    tracker.resync()
    whole = tracker.take()
    assert whole is not None and whole.changed is None
    assert_same(state.translation, translate(whole.services, whole.slices, NODE))


# --- the manifest source's partial syncs -------------------------------------------------

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {{name: svc-{i}, namespace: default}}
spec:
  clusterIP: 10.96.1.{i}
  ports: [{{name: http, port: 80, protocol: TCP}}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: svc-{i}-1
  namespace: default
  labels: {{kubernetes.io/service-name: svc-{i}}}
addressType: IPv4
endpoints: [{{addresses: ["{backend}"]}}]
ports: [{{name: http, port: 8080, protocol: TCP}}]
"""


def test_a_one_file_change_in_a_directory_of_many_services_touches_only_its_frontends(
    tmp_path: Path,
) -> None:
    for i in range(1, 51):
        (tmp_path / f"svc-{i}.yaml").write_text(SERVICE.format(i=i, backend="10.244.0.1"))
    source, state = ManifestSource(tmp_path), DesiredState()
    snapshot = source.poll()
    assert snapshot is not None and snapshot.changed is None
    assert state.update(snapshot.services, snapshot.slices, NODE, snapshot.changed) is None
    assert len(state.translation.frontends) == 50
    edited = tmp_path / "svc-17.yaml"
    edited.write_text(SERVICE.format(i=17, backend="10.244.0.99"))
    stat = edited.stat()
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    snapshot = source.poll()
    assert snapshot is not None and snapshot.changed == {("default", "svc-17")}
    touched = state.update(snapshot.services, snapshot.slices, NODE, snapshot.changed)
    frontend = Frontend(ip_address("10.96.1.17"), 80, "TCP")
    assert touched == {frontend}
    assert [str(b) for b in state.translation.frontends[frontend].backends] == ["10.244.0.99:8080"]
    assert len(state.translation.frontends) == 50


def test_the_losers_problem_names_the_port_that_claims_the_frontend() -> None:
    dns = ServicePort("dns", "UDP", 53)
    http = ServicePort("http", "TCP", 80)
    state = DesiredState()
    fold(state, service("b", ports=(dns, http)))
    fold(state, service("a", ports=(http,)))
    (problem,) = state.translation.problems
    assert (problem.ref.name, problem.field) == ("b", "spec.ports[1]")
