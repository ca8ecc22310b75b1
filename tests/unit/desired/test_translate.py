"""Services and EndpointSlices → frontends and backends (kpr/desired/translate.py)."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kpr.desired.state import translate
from kpr.desired.translate import (
    cluster_endpoints,
    local_endpoints,
    merge_endpoints,
    select_backends,
    topology_mode,
)
from kpr.model import (
    EXTERNAL,
    SOCKET,
    Backend,
    Endpoint,
    EndpointPort,
    EndpointSlice,
    Frontend,
    NodeContext,
    ObjectRef,
    Service,
    ServicePort,
    address_value,
)
from kpr.sources.manifests import ManifestSource
from tests.support.builders import (
    EXTERNAL_NODE,
    HTTP,
    HTTP_NP,
    NODE_IP,
    endpoint,
    endpoint_slice,
    service,
)
from tests.support.paths import REPO

NODE = NodeContext(name="node-1", zone="zone-a")
VIP = ip_address("10.96.0.10")
VIP6 = ip_address("fd00:96::10")
EXAMPLES = REPO / "examples" / "manifests"


def backends_of(
    services: list[Service],
    slices: list[EndpointSlice],
    frontend: Frontend | None = None,
    node: NodeContext = NODE,
) -> list[str]:
    translation = translate(services, slices, node)
    state = translation.frontends[frontend or Frontend(VIP, 80, "TCP")]
    return [str(backend) for backend in state.backends]


# --- which Services are served ---------------------------------------------------------


def test_cluster_ip_port_becomes_a_frontend_with_its_ready_endpoints() -> None:
    translation = translate(
        [service()], [endpoint_slice(endpoint("10.244.1.12"), endpoint("10.244.1.11"))], NODE
    )
    state = translation.frontends[Frontend(VIP, 80, "TCP")]
    assert state.service == "default/web:http"
    assert state.backends == (
        Backend(ip_address("10.244.1.11"), 8080),
        Backend(ip_address("10.244.1.12"), 8080),
    )
    assert state.affinity_timeout == 0
    assert translation.problems == []
    assert translation.held == set()


def test_unnamed_port_is_named_after_the_service_alone() -> None:
    port = ServicePort(name="", protocol="TCP", port=80)
    translation = translate(
        [service(ports=(port,))],
        [endpoint_slice(endpoint("10.244.1.11"), ports=(EndpointPort("", "TCP", 8080),))],
        NODE,
    )
    assert translation.frontends[Frontend(VIP, 80, "TCP")].service == "default/web"


def test_service_without_endpoints_has_a_frontend_with_no_backends() -> None:
    translation = translate([service()], [], NODE)
    assert translation.frontends[Frontend(VIP, 80, "TCP")].backends == ()


def test_tcp_and_udp_on_one_port_are_two_frontends() -> None:
    ports = (ServicePort("dns-tcp", "TCP", 53), ServicePort("dns", "UDP", 53))
    translation = translate([service(ports=ports)], [], NODE)
    assert set(translation.frontends) == {Frontend(VIP, 53, "TCP"), Frontend(VIP, 53, "UDP")}


def test_headless_and_external_name_services_are_skipped() -> None:
    headless = service(name="headless", cluster_ips=())
    external = service(name="external", type="ExternalName")
    translation = translate([headless, external], [], NODE)
    assert translation.frontends == {}
    assert translation.problems == []


def test_service_for_another_proxy_is_skipped_and_one_for_ours_is_served() -> None:
    label = "service.kubernetes.io/service-proxy-name"
    theirs = service(name="theirs", labels={label: "cilium"})
    ours = service(name="ours", cluster_ips=("10.96.0.11",), labels={label: "kpr"})
    translation = translate([theirs, ours], [], NodeContext(name="node-1", proxy_name="kpr"))
    assert set(translation.frontends) == {Frontend(ip_address("10.96.0.11"), 80, "TCP")}


def test_sctp_port_is_skipped_with_a_problem_while_others_are_served() -> None:
    ports = (ServicePort("sig", "SCTP", 3868), HTTP)
    translation = translate([service(ports=ports)], [], NODE)
    assert set(translation.frontends) == {Frontend(VIP, 80, "TCP")}
    assert translation.held == set()
    (problem,) = translation.problems
    assert str(problem) == (
        "Service default/web: spec.ports[0].protocol: "
        "3868/SCTP is not served: kpr handles TCP and UDP only"
    )


def test_client_ip_affinity_sets_the_timeout() -> None:
    sticky = service(session_affinity="ClientIP", affinity_timeout=600)
    assert translate([sticky], [], NODE).frontends[Frontend(VIP, 80, "TCP")].affinity_timeout == 600


def test_two_services_claiming_one_frontend_the_first_by_namespace_and_name_wins() -> None:
    first = service(name="alpha", namespace="default")
    second = service(name="beta", namespace="default")
    slices = [
        endpoint_slice(endpoint("10.244.1.11"), name="alpha-1", service_name="alpha"),
        endpoint_slice(endpoint("10.244.1.22"), name="beta-1", service_name="beta"),
    ]
    translation = translate([second, first], slices, NODE)
    state = translation.frontends[Frontend(VIP, 80, "TCP")]
    assert state.service == "default/alpha:http"
    assert [str(b) for b in state.backends] == ["10.244.1.11:8080"]
    (problem,) = translation.problems
    assert problem.ref == ObjectRef("Service", "default", "beta")
    assert "Service default/alpha" in problem.message
    assert "10.96.0.10:80/TCP" in problem.message


# --- dual-stack ---------------------------------------------------------------------


def test_each_cluster_ip_takes_backends_from_slices_of_its_family() -> None:
    dual = service(cluster_ips=("10.96.0.10", "fd00:96::10"))
    slices = [
        endpoint_slice(endpoint("10.244.1.11"), name="web-v4"),
        endpoint_slice(endpoint("fd00:244::11"), name="web-v6", address_type="IPv6"),
    ]
    assert backends_of([dual], slices) == ["10.244.1.11:8080"]
    assert backends_of([dual], slices, Frontend(VIP6, 80, "TCP")) == ["[fd00:244::11]:8080"]


def test_single_stack_ipv6_service_ignores_ipv4_slices() -> None:
    v6 = service(cluster_ips=("fd00:96::10",))
    slices = [
        endpoint_slice(endpoint("10.244.1.11"), name="web-v4"),
        endpoint_slice(endpoint("fd00:244::11"), name="web-v6", address_type="IPv6"),
    ]
    assert backends_of([v6], slices, Frontend(VIP6, 80, "TCP")) == ["[fd00:244::11]:8080"]


# --- which slices and ports count -----------------------------------------------------------


def test_endpoints_are_merged_across_a_services_slices() -> None:
    slices = [
        endpoint_slice(endpoint("10.244.1.11"), name="web-1"),
        endpoint_slice(endpoint("10.244.1.12"), endpoint("10.244.1.11"), name="web-2"),
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080", "10.244.1.12:8080"]


def test_duplicate_endpoint_across_slices_the_non_terminating_one_wins() -> None:
    terminating = endpoint("10.244.1.11", ready=False, serving=True, terminating=True)
    ready = endpoint("10.244.1.11")
    other_terminating = endpoint("10.244.1.12", ready=False, serving=True, terminating=True)
    for first, second in ((terminating, ready), (ready, terminating)):
        slices = [
            endpoint_slice(first, other_terminating, name="web-1"),
            endpoint_slice(second, name="web-2"),
        ]
        # Were the terminating copy kept, no endpoint would be ready and both would serve.
        assert backends_of([service()], slices) == ["10.244.1.11:8080"]


def test_slices_of_other_services_and_namespaces_do_not_count() -> None:
    other = service(name="other", cluster_ips=("10.96.0.11",))
    slices = [
        endpoint_slice(endpoint("10.244.1.11"), name="web-1"),
        endpoint_slice(endpoint("10.244.1.22"), name="other-1", service_name="other"),
        endpoint_slice(endpoint("10.244.1.33"), name="web-x", namespace="elsewhere"),
    ]
    translation = translate([service(), other], slices, NODE)
    assert [str(b) for b in translation.frontends[Frontend(VIP, 80, "TCP")].backends] == [
        "10.244.1.11:8080"
    ]
    (problem,) = translation.problems  # the slice in "elsewhere" names a missing Service
    assert problem.ref == ObjectRef("EndpointSlice", "elsewhere", "web-x")


def test_slice_without_service_name_label_is_ignored() -> None:
    slices = [endpoint_slice(endpoint("10.244.1.11"), service_name=None)]
    translation = translate([service()], slices, NODE)
    assert translation.frontends[Frontend(VIP, 80, "TCP")].backends == ()
    assert translation.problems == []


def test_slice_naming_a_missing_service_is_a_problem() -> None:
    slices = [endpoint_slice(endpoint("10.244.1.11"), name="gone-1", service_name="gone")]
    translation = translate([service()], slices, NODE)
    (problem,) = translation.problems
    assert str(problem) == (
        "EndpointSlice default/gone-1: metadata.labels[kubernetes.io/service-name]: "
        "names Service default/gone, which does not exist"
    )


def test_fqdn_slices_are_ignored() -> None:
    fqdn = endpoint_slice(name="web-fqdn", address_type="FQDN")
    translation = translate([service()], [fqdn], NODE)
    assert translation.frontends[Frontend(VIP, 80, "TCP")].backends == ()
    assert translation.problems == []


def test_service_port_takes_the_slice_port_with_its_name_and_protocol() -> None:
    ports = (ServicePort("http", "TCP", 80), ServicePort("metrics", "TCP", 9090))
    slice_ports = (
        EndpointPort("metrics", "TCP", 9100),
        EndpointPort("http", "UDP", 7000),
        EndpointPort("http", "TCP", 8080),
    )
    slices = [endpoint_slice(endpoint("10.244.1.11"), ports=slice_ports)]
    assert backends_of([service(ports=ports)], slices) == ["10.244.1.11:8080"]
    metrics = Frontend(VIP, 9090, "TCP")
    assert backends_of([service(ports=ports)], slices, metrics) == ["10.244.1.11:9100"]


def test_slice_port_with_no_number_or_zero_is_ignored() -> None:
    for number in (None, 0):
        slices = [
            endpoint_slice(endpoint("10.244.1.11"), ports=(EndpointPort("http", "TCP", number),))
        ]
        assert backends_of([service()], slices) == []


def test_one_endpoint_on_two_slice_port_numbers_is_two_backends() -> None:
    slices = [
        endpoint_slice(endpoint("10.244.1.11"), name="web-1"),
        endpoint_slice(
            endpoint("10.244.1.11"), name="web-2", ports=(EndpointPort("http", "TCP", 8081),)
        ),
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080", "10.244.1.11:8081"]


# --- which endpoints receive traffic: Cluster policy ----------------------------------------


def test_not_ready_endpoints_get_no_traffic_while_any_is_ready() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11"),
            endpoint("10.244.1.12", ready=False, serving=False),
            endpoint("10.244.1.13", ready=False, serving=True, terminating=True),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080"]


def test_with_none_ready_serving_terminating_endpoints_take_the_traffic() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", ready=False, serving=True, terminating=True),
            endpoint("10.244.1.12", ready=False, serving=False, terminating=True),
            endpoint("10.244.1.13", ready=False, serving=False),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080"]


def test_terminating_fallback_ignores_topology_hints() -> None:
    slices = [
        endpoint_slice(
            endpoint(
                "10.244.1.11",
                ready=False,
                terminating=True,
                hints_for_zones=("zone-b",),
            ),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080"]


def test_zone_hints_narrow_to_endpoints_for_this_zone() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_zones=("zone-a",)),
            endpoint("10.244.1.12", hints_for_zones=("zone-b",)),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080"]


def test_node_hints_win_over_zone_hints_when_all_endpoints_have_them() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_nodes=("node-2",), hints_for_zones=("zone-a",)),
            endpoint("10.244.1.12", hints_for_nodes=("node-1",), hints_for_zones=("zone-b",)),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.12:8080"]


def test_hints_are_ignored_unless_every_ready_endpoint_has_them() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_zones=("zone-a",)),
            endpoint("10.244.1.12"),
            # Not ready: its missing hint does not matter, and it gets no traffic.
            endpoint("10.244.1.13", ready=False, serving=False, hints_for_zones=("zone-a",)),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080", "10.244.1.12:8080"]
    complete = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_zones=("zone-a",)),
            endpoint("10.244.1.12", hints_for_zones=("zone-b",)),
            endpoint("10.244.1.13", ready=False, serving=False),
        )
    ]
    assert backends_of([service()], complete) == ["10.244.1.11:8080"]


def test_hints_are_ignored_when_none_is_for_this_node_or_zone() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_nodes=("node-2",), hints_for_zones=("zone-b",)),
            endpoint("10.244.1.12", hints_for_nodes=("node-3",), hints_for_zones=("zone-c",)),
        )
    ]
    assert backends_of([service()], slices) == ["10.244.1.11:8080", "10.244.1.12:8080"]


def test_node_without_zone_or_name_ignores_hints() -> None:
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", hints_for_nodes=("node-1",), hints_for_zones=("zone-a",)),
            endpoint("10.244.1.12", hints_for_nodes=("node-2",), hints_for_zones=("zone-b",)),
        )
    ]
    assert backends_of([service()], slices, node=NodeContext()) == [
        "10.244.1.11:8080",
        "10.244.1.12:8080",
    ]


def test_topology_mode_is_node_then_zone_then_none() -> None:
    both = endpoint("10.0.0.1", hints_for_nodes=("node-1",), hints_for_zones=("zone-a",))
    zone_only = endpoint("10.0.0.2", hints_for_zones=("zone-a",))
    assert topology_mode([both], NODE) == "Node"
    assert topology_mode([both, zone_only], NODE) == "Zone"
    assert topology_mode([both, endpoint("10.0.0.3")], NODE) is None
    assert topology_mode([], NODE) is None


# --- which endpoints receive traffic: Local policy -----------------------------------------


def test_local_policy_sends_to_ready_endpoints_on_this_node_only() -> None:
    local = service(internal_traffic_policy="Local")
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", node_name="node-1"),
            endpoint("10.244.1.12", node_name="node-2"),
            endpoint("10.244.1.13", node_name="node-1", ready=False, terminating=True),
        )
    ]
    assert backends_of([local], slices) == ["10.244.1.11:8080"]


def test_local_policy_falls_back_to_local_serving_terminating_endpoints() -> None:
    local = service(internal_traffic_policy="Local")
    slices = [
        endpoint_slice(
            endpoint("10.244.1.11", node_name="node-2"),
            endpoint("10.244.1.12", node_name="node-1", ready=False, terminating=True),
            endpoint("10.244.1.13", node_name="node-1", ready=False, serving=False),
        )
    ]
    assert backends_of([local], slices) == ["10.244.1.12:8080"]


def test_local_policy_with_no_local_endpoints_has_no_backends() -> None:
    local = service(internal_traffic_policy="Local")
    slices = [endpoint_slice(endpoint("10.244.1.11", node_name="node-2"))]
    assert backends_of([local], slices) == []


def test_cluster_and_local_policies_fall_back_independently() -> None:
    endpoints = {
        Backend(ip_address("10.244.1.11"), 80): endpoint("10.244.1.11", node_name="node-2"),
        Backend(ip_address("10.244.1.12"), 80): endpoint(
            "10.244.1.12", node_name="node-1", ready=False, terminating=True
        ),
    }
    assert [str(b) for b in cluster_endpoints(endpoints, NODE)] == ["10.244.1.11:80"]
    assert [str(b) for b in local_endpoints(endpoints, NODE)] == ["10.244.1.12:80"]


# --- limits -----------------------------------------------------------------------------------


def test_a_service_of_5000_endpoints_is_served_whole() -> None:
    # kube-proxy has no limit; kpr's was 4,096 (held, never programmed when new)
    many = [endpoint(str(IPv4Address("10.128.0.1") + i)) for i in range(5000)]
    slices = [endpoint_slice(*many[:2000], name="a"), endpoint_slice(*many[2000:], name="b")]
    translation = translate([service()], slices, NODE)
    assert translation.held == set() and translation.problems == []
    assert len(translation.frontends[Frontend(VIP, 80, "TCP")].backends) == 5000


# --- the example used by the demo -----------------------------------------------------------


def test_example_manifests_translate_to_four_frontends_of_three_backends() -> None:
    snapshot = ManifestSource(EXAMPLES).poll()
    assert snapshot is not None
    assert snapshot.problems == []
    translation = translate(snapshot.services, snapshot.slices, NodeContext(name="node-1"))
    assert translation.problems == []
    assert set(translation.frontends) == {
        Frontend(VIP, 80, "TCP"),
        Frontend(VIP, 53, "UDP"),
        Frontend(VIP6, 80, "TCP"),
        Frontend(VIP6, 53, "UDP"),
    }
    for frontend, state in translation.frontends.items():
        assert len(state.backends) == 3
        assert {b.address.version for b in state.backends} == {frontend.family}
        assert {b.port for b in state.backends} == {8080}


# --- properties ----------------------------------------------------------------------------

names = st.sampled_from(["web", "api", "db"])
port_names = st.sampled_from(["", "http", "dns"])
protocols = st.sampled_from(["TCP", "UDP", "SCTP"])
ipv4 = st.integers(0, 255).map(lambda i: IPv4Address("10.244.0.0") + i)
ipv6 = st.integers(0, 255).map(lambda i: IPv6Address("fd00:244::") + i)
hints = st.none() | st.lists(st.sampled_from(["node-1", "node-2", "zone-a", "zone-b"])).map(tuple)


@st.composite
def services(draw: st.DrawFn) -> Service:
    ports = draw(
        st.lists(
            st.builds(ServicePort, name=port_names, protocol=protocols, port=st.integers(1, 65535)),
            max_size=3,
            unique_by=(lambda p: p.name, lambda p: (p.port, p.protocol)),
        )
    )
    families = draw(st.sampled_from([(), (4,), (6,), (4, 6), (6, 4)]))
    # A few addresses per family, so that Services collide on frontends now and then.
    first_ip = {4: IPv4Address("10.96.0.1"), 6: IPv6Address("fd00:96::1")}
    cluster_ips = tuple(first_ip[family] + draw(st.integers(0, 3)) for family in families)
    return Service(
        namespace=draw(st.sampled_from(["default", "shop"])),
        name=draw(names),
        type=draw(st.sampled_from(["ClusterIP", "NodePort", "ExternalName"])),
        cluster_ips=cluster_ips,
        ports=tuple(ports),
        session_affinity=draw(st.sampled_from(["None", "ClientIP"])),
        internal_traffic_policy=draw(st.sampled_from(["Cluster", "Local"])),
    )


@st.composite
def endpoint_slices(draw: st.DrawFn) -> EndpointSlice:
    address_type = draw(st.sampled_from(["IPv4", "IPv6", "FQDN"]))
    addresses = ipv4 if address_type == "IPv4" else ipv6
    endpoints = draw(
        st.lists(
            st.builds(
                Endpoint,
                ip=addresses.map(address_value),
                ready=st.booleans(),
                serving=st.booleans(),
                terminating=st.booleans(),
                node_name=st.none() | st.sampled_from(["node-1", "node-2"]),
                zone=st.none() | st.sampled_from(["zone-a", "zone-b"]),
                hints_for_nodes=hints,
                hints_for_zones=hints,
            ),
            max_size=8,
        )
    )
    return EndpointSlice(
        namespace=draw(st.sampled_from(["default", "shop"])),
        name=draw(st.sampled_from(["s1", "s2", "s3", "s4"])),
        service_name=draw(st.none() | names),
        address_type=address_type,
        ports=tuple(
            draw(
                st.lists(
                    st.builds(
                        EndpointPort,
                        name=port_names,
                        protocol=protocols,
                        port=st.none() | st.integers(0, 65535),
                    ),
                    max_size=3,
                )
            )
        ),
        endpoints=() if address_type == "FQDN" else tuple(endpoints),
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(services(), max_size=5),
    st.lists(endpoint_slices(), max_size=6),
    st.builds(
        NodeContext,
        name=st.none() | st.sampled_from(["node-1", "node-2"]),
        zone=st.none() | st.sampled_from(["zone-a", "zone-b"]),
    ),
)
def test_translate_never_raises_and_backends_are_sorted_and_unique(
    services: list[Service], slices: list[EndpointSlice], node: NodeContext
) -> None:
    translation = translate(services, slices, node)
    assert not set(translation.frontends) & translation.held
    for frontend, state in translation.frontends.items():
        assert frontend.protocol in ("TCP", "UDP")
        assert list(state.backends) == sorted(set(state.backends))
        assert all(backend.address.version == frontend.family for backend in state.backends)


# --- NodePort, LoadBalancer and external IPs ---------------------------------------

LB_IP = ip_address("203.0.113.7")


def _external_setup(**fields: Any) -> tuple[Service, EndpointSlice]:
    svc = service(ports=(HTTP_NP,), **fields)
    local = endpoint("10.244.1.11", node_name="node-1")
    remote = endpoint("10.244.2.11", node_name="node-2")
    return svc, endpoint_slice(local, remote)


def test_node_port_is_served_on_node_addresses_for_both_scopes_and_localhost_at_the_socket():
    svc, eps = _external_setup(type="NodePort")
    frontends = translate([svc], [eps], EXTERNAL_NODE).frontends
    both = (Backend(ip_address("10.244.1.11"), 8080), Backend(ip_address("10.244.2.11"), 8080))
    assert frontends[Frontend(NODE_IP, 30080, "TCP", SOCKET)].backends == both
    assert frontends[Frontend(NODE_IP, 30080, "TCP", EXTERNAL)].backends == both
    assert frontends[Frontend(NODE_IP, 30080, "TCP", EXTERNAL)].kind == "NodePort"
    localhost = Frontend(ip_address("127.0.0.1"), 30080, "TCP", SOCKET)
    assert frontends[localhost].backends == both
    assert Frontend(ip_address("127.0.0.1"), 30080, "TCP", EXTERNAL) not in frontends
    # a ClusterIP Service with a stray nodePort value gets no NodePort
    plain = translate([service(ports=(HTTP_NP,))], [eps], EXTERNAL_NODE).frontends
    assert {f.address for f in plain} == {VIP}


def test_localhost_node_ports_can_be_switched_off():
    svc, eps = _external_setup(type="NodePort")
    node = NodeContext(name="node-1", node_port_addresses=(NODE_IP,), localhost_node_ports=False)
    assert ip_address("127.0.0.1") not in {
        f.address for f in translate([svc], [eps], node).frontends
    }


def test_external_traffic_policy_local_narrows_only_the_external_scope():
    svc, eps = _external_setup(type="NodePort", external_traffic_policy="Local")
    frontends = translate([svc], [eps], EXTERNAL_NODE).frontends
    local = (Backend(ip_address("10.244.1.11"), 8080),)
    assert frontends[Frontend(NODE_IP, 30080, "TCP", EXTERNAL)].backends == local
    # processes and pods on the node still reach every endpoint, as kube-proxy short-circuits them
    assert len(frontends[Frontend(NODE_IP, 30080, "TCP", SOCKET)].backends) == 2
    assert len(frontends[Frontend(VIP, 80, "TCP", SOCKET)].backends) == 2


def test_load_balancer_ips_with_source_ranges_and_external_ips():
    ranges = (ip_network("198.51.100.0/24"), ip_network("2001:db8::/32"))
    svc, eps = _external_setup(
        type="LoadBalancer",
        load_balancer_ips=(LB_IP,),
        load_balancer_source_ranges=ranges,
        external_ips=(ip_address("192.0.2.9"),),
    )
    frontends = translate([svc], [eps], EXTERNAL_NODE).frontends
    lb = frontends[Frontend(LB_IP, 80, "TCP", EXTERNAL)]
    assert (lb.kind, lb.source_ranges) == ("LoadBalancer", (ip_network("198.51.100.0/24"),))
    # ranges restrict the LoadBalancer IP only: never the NodePort, nor an external IP
    assert frontends[Frontend(NODE_IP, 30080, "TCP", EXTERNAL)].source_ranges == ()
    external_ip = frontends[Frontend(ip_address("192.0.2.9"), 80, "TCP", EXTERNAL)]
    assert (external_ip.kind, external_ip.source_ranges) == ("ExternalIP", ())
    # the node's own clients: only when a range holds a node address (allowFromNode)
    assert Frontend(LB_IP, 80, "TCP", SOCKET) not in frontends
    with_node = replace(svc, load_balancer_source_ranges=(*ranges, ip_network("192.168.50.0/24")))
    assert (
        Frontend(LB_IP, 80, "TCP", SOCKET) in translate([with_node], [eps], EXTERNAL_NODE).frontends
    )
    # status IPs of a Service that is no longer a LoadBalancer are not served
    demoted = translate([replace(svc, type="NodePort")], [eps], EXTERNAL_NODE).frontends
    assert LB_IP not in {f.address for f in demoted}


def test_external_addresses_of_a_family_the_service_lacks_are_not_served():
    svc, eps = _external_setup(type="LoadBalancer", load_balancer_ips=(ip_address("2001:db8::7"),))
    node = NodeContext(node_port_addresses=(NODE_IP, ip_address("fd00::2")))
    addresses = {f.address for f in translate([svc], [eps], node).frontends}
    assert ip_address("2001:db8::7") not in addresses
    assert ip_address("fd00::2") not in addresses
    assert NODE_IP in addresses


def test_two_services_on_one_node_port_the_first_keeps_it():
    first, eps = _external_setup(type="NodePort")
    second = service(name="zz", cluster_ips=("10.96.0.11",), ports=(HTTP_NP,), type="NodePort")
    translation = translate([second, first], [eps], EXTERNAL_NODE)
    owner = translation.owners[Frontend(NODE_IP, 30080, "TCP", EXTERNAL)]
    assert owner == ("default", "web")
    assert any("30080" in str(p) and "zz" in str(p) for p in translation.problems)


def test_health_check_node_port_counts_local_ready_endpoints_per_port_as_kube_proxy():
    ports = (HTTP_NP, ServicePort(name="metrics", protocol="TCP", port=9090, node_port=30090))
    svc = service(
        ports=ports,
        type="LoadBalancer",
        external_traffic_policy="Local",
        health_check_node_port=32100,
    )
    slice_ports = (EndpointPort("http", "TCP", 8080), EndpointPort("metrics", "TCP", 9090))
    eps = endpoint_slice(
        endpoint("10.244.1.11", node_name="node-1"),
        endpoint("10.244.1.12", node_name="node-1", ready=False),
        endpoint("10.244.2.11", node_name="node-2"),
        ports=slice_ports,
    )
    translation = translate([svc], [eps], EXTERNAL_NODE)
    assert translation.health_checks == {("default", "web"): (32100, 2)}
    cluster = replace(svc, external_traffic_policy="Cluster")
    assert translate([cluster], [eps], EXTERNAL_NODE).health_checks == {}


def test_local_policy_without_a_local_endpoint_drops_where_no_endpoint_at_all_refuses():
    svc = service(ports=(HTTP_NP,), type="NodePort", external_traffic_policy="Local")
    remote_only = endpoint_slice(endpoint("10.244.2.11", node_name="node-2"))
    external = Frontend(NODE_IP, 30080, "TCP", EXTERNAL)
    state = translate([svc], [remote_only], EXTERNAL_NODE).frontends[external]
    assert (state.backends, state.drop) == ((), True)
    state = translate([svc], [], EXTERNAL_NODE).frontends[external]
    assert (state.backends, state.drop) == ((), False)


@pytest.mark.parametrize(
    "serving,terminating,drop",
    [(True, True, True), (False, True, False), (True, False, False)],
)
def test_endpoints_elsewhere_that_only_serve_while_terminating_count_as_endpoints(
    serving, terminating, drop
):
    # kube-proxy's CategorizeEndpoints: under a Local policy a serving, terminating
    # endpoint anywhere is an endpoint (hasAnyEndpoints), so there being none here drops;
    # one that is not serving (or not ready and not terminating) counts for nothing
    svc = service(ports=(HTTP_NP,), type="NodePort", external_traffic_policy="Local")
    remote = endpoint_slice(
        endpoint(
            "10.244.2.11",
            node_name="node-2",
            ready=False,
            serving=serving,
            terminating=terminating,
        )
    )
    state = translate([svc], [remote], EXTERNAL_NODE).frontends[
        Frontend(NODE_IP, 30080, "TCP", EXTERNAL)
    ]
    assert (state.backends, state.drop) == ((), drop)


def test_external_ips_outside_the_allowed_cidrs_are_not_served_and_named():
    svc = service(external_ips=(ip_address("192.0.2.9"), ip_address("198.51.100.4")))
    node = NodeContext(external_ip_cidrs=(ip_network("198.51.100.0/24"),))
    translation = translate([svc], [endpoint_slice(endpoint("10.244.1.11"))], node)
    addresses = {f.address for f in translation.frontends}
    assert ip_address("198.51.100.4") in addresses and ip_address("192.0.2.9") not in addresses
    [problem] = translation.problems
    assert (problem.field, "192.0.2.9" in problem.message) == ("spec.externalIPs[0]", True)
    # without the flag every externalIP is served, as kube-proxy does
    everything = translate([svc], [endpoint_slice(endpoint("10.244.1.11"))], NodeContext())
    assert ip_address("192.0.2.9") in {f.address for f in everything.frontends}


def test_no_local_endpoints_are_counted_per_port_and_policy_as_kube_proxy():
    # two ports, endpoints only on node-2: each port counts, internal and external apart
    https = ServicePort(name="https", protocol="TCP", port=443, node_port=30443)
    svc = service(
        ports=(HTTP_NP, https),
        type="NodePort",
        internal_traffic_policy="Local",
        external_traffic_policy="Local",
    )
    slice_ports = (EndpointPort("http", "TCP", 8080), EndpointPort("https", "TCP", 8443))
    remote = endpoint_slice(endpoint("10.244.2.11", node_name="node-2"), ports=slice_ports)
    assert translate([svc], [remote], EXTERNAL_NODE).no_local_endpoints == {
        ("default", "web"): (2, 2)
    }
    # externalTrafficPolicy alone; a ClusterIP Service has no external traffic to count
    external_only = replace(svc, internal_traffic_policy="Cluster")
    assert translate([external_only], [remote], EXTERNAL_NODE).no_local_endpoints == {
        ("default", "web"): (0, 2)
    }
    cluster_ip = service(internal_traffic_policy="Local", external_traffic_policy="Local")
    remote_ip = endpoint_slice(endpoint("10.244.2.11", node_name="node-2"))
    assert translate([cluster_ip], [remote_ip], NODE).no_local_endpoints == {
        ("default", "web"): (1, 0)
    }
    # a local endpoint, or no endpoint anywhere, is not counted
    local = endpoint_slice(endpoint("10.244.1.11", node_name="node-1"), ports=slice_ports)
    assert translate([svc], [local], EXTERNAL_NODE).no_local_endpoints == {}
    assert translate([svc], [], EXTERNAL_NODE).no_local_endpoints == {}


def test_endpoints_on_this_node_of_services_with_external_frontends_are_listed():
    """The TC path keeps the client address for these only: every other external flow is
    masqueraded (externalTrafficPolicy Cluster), whatever device it leaves by."""
    svc, eps = _external_setup(type="NodePort")
    local = translate([svc], [eps], EXTERNAL_NODE).local_endpoints
    assert local == {("default", "web"): frozenset({ip_address("10.244.1.11")})}
    plain = translate([service(ports=(HTTP_NP,))], [eps], EXTERNAL_NODE)
    assert plain.local_endpoints == {}  # ClusterIP only: the TC path never sees it


@st.composite
def slices_of_one_service(draw: st.DrawFn) -> list[EndpointSlice]:
    """A Service's slices with everything that changes which backends a port gets:
    readiness, termination, an ip:port in two slices, other ports, hints."""
    slices = []
    for n in range(draw(st.integers(0, 3))):
        endpoints = [
            endpoint(
                f"10.0.0.{draw(st.integers(1, 6))}",
                ready=draw(st.booleans()),
                serving=draw(st.booleans()),
                terminating=draw(st.booleans()),
                hints_for_zones=draw(st.sampled_from([None, ("zone-a",), ("zone-b",)])),
            )
            for _ in range(draw(st.integers(0, 4)))
        ]
        ports = draw(
            st.sampled_from(
                [
                    (EndpointPort("http", "TCP", 8080),),
                    (EndpointPort("http", "TCP", 8080), EndpointPort("http", "TCP", 9090)),
                    (EndpointPort("http", "UDP", 8080), EndpointPort("other", "TCP", 8080)),
                    (EndpointPort("http", "TCP", None),),
                ]
            )
        )
        slices.append(endpoint_slice(*endpoints, name=f"web-{n}", ports=ports))
    return slices


@settings(max_examples=300, deadline=None)
@given(slices_of_one_service())
def test_backends_read_from_packed_endpoints_equal_the_merged_ones(
    slices: list[EndpointSlice],
) -> None:
    """The Cluster policy's backends are read from the slices' packed columns when no ip:port
    is in two slices and no endpoint has hints: the same backends as merging does."""
    port = ServicePort("http", "TCP", 80)
    merged = merge_endpoints(port, slices)
    expected = tuple(sorted(cluster_endpoints(merged, NODE), key=Backend.sort_key))
    assert select_backends(port, slices, "Cluster", NODE) == expected
