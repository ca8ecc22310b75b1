"""Validation of API-shaped Service and EndpointSlice dicts (kpr/sources/objects.py)."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpr.model import Endpoint, EndpointPort, Endpoints, ObjectRef, ServicePort, address_value
from kpr.sources import objects
from kpr.sources.objects import (
    ObjectError,
    _endpoint,
    parse_endpoint_slice,
    parse_object,
    parse_service,
)
from kpr.sources.wire import (
    decode_service_page,
    decode_slice_page,
    parse_listed_service,
    parse_listed_slice,
)


def service_dict(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}], **spec},
    }


def slice_dict(
    endpoints: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
    ports: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "web-abc12",
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": address_type,
        "endpoints": endpoints if endpoints is not None else [{"addresses": ["10.244.0.5"]}],
        "ports": ports if ports is not None else [{"name": "", "port": 8080, "protocol": "TCP"}],
    }


def via_list_page(obj: dict[str, Any]) -> Any:
    """A Service or an EndpointSlice as the agent reads it from a list page
    (kpr/sources/wire.py)."""
    decode, parse = (
        (decode_service_page, parse_listed_service)
        if obj.get("kind") == "Service"
        else (decode_slice_page, parse_listed_slice)
    )
    page = {"kind": "List", "metadata": {"resourceVersion": "7"}, "items": [obj]}
    metadata, items = decode(orjson.dumps(page))
    assert metadata["resourceVersion"] == "7"
    return parse(items[0])


@pytest.fixture(autouse=True, params=["dict", "list page"])
def object_reading(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Service and EndpointSlice case read both ways: a watch event's dict, and a
    list page decoded into structs (which must give the same objects and errors)."""
    if request.param == "list page":
        monkeypatch.setitem(globals(), "parse_endpoint_slice", via_list_page)
        monkeypatch.setitem(globals(), "parse_service", via_list_page)


def error_of(parse: Any, obj: dict[str, Any]) -> ObjectError:
    with pytest.raises(ObjectError) as caught:
        parse(obj)
    return caught.value


# --- Service ---------------------------------------------------------------------


def test_service_defaults_are_the_api_defaults() -> None:
    service = parse_service(service_dict())
    assert service.type == "ClusterIP"
    assert service.cluster_ips == (ip_address("10.96.0.1"),)
    assert service.ports == (ServicePort(name="", protocol="TCP", port=80),)
    assert service.session_affinity == "None"
    assert service.affinity_timeout == 10800
    assert service.internal_traffic_policy == "Cluster"
    assert service.external_traffic_policy == "Cluster"


def test_namespace_defaults_to_default() -> None:
    obj = service_dict()
    del obj["metadata"]["namespace"]
    assert parse_service(obj).ref == ObjectRef("Service", "default", "web")


def test_service_reads_ports_policies_affinity_and_external_ips() -> None:
    service = parse_service(
        service_dict(
            type="NodePort",
            ports=[
                {"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080},
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 5353},
            ],
            externalIPs=["192.0.2.7"],
            sessionAffinity="ClientIP",
            sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
            internalTrafficPolicy="Local",
            externalTrafficPolicy="Local",
        )
    )
    assert service.type == "NodePort"
    assert service.ports == (
        ServicePort("http", "TCP", 80, node_port=30080),
        ServicePort("dns", "UDP", 53),
    )
    assert service.external_ips == (ip_address("192.0.2.7"),)
    assert (service.session_affinity, service.affinity_timeout) == ("ClientIP", 60)
    assert service.internal_traffic_policy == service.external_traffic_policy == "Local"


def test_client_ip_affinity_timeout_defaults_to_10800() -> None:
    service = parse_service(service_dict(sessionAffinity="ClientIP"))
    assert service.affinity_timeout == 10800


def test_dual_stack_cluster_ips_come_from_cluster_ips() -> None:
    service = parse_service(service_dict(clusterIPs=["10.96.0.1", "fd00:96::1"]))
    assert service.cluster_ips == (ip_address("10.96.0.1"), ip_address("fd00:96::1"))


@pytest.mark.parametrize(
    "spec",
    [{"clusterIP": "None"}, {"clusterIP": ""}, {"clusterIP": "None", "clusterIPs": ["None"]}, {}],
    ids=["None", "empty", "clusterIPs None", "missing"],
)
def test_headless_service_has_no_cluster_ips(spec: dict[str, Any]) -> None:
    obj = service_dict(**spec)
    if not spec:
        del obj["spec"]["clusterIP"]
    assert parse_service(obj).cluster_ips == ()


def test_the_labels_kpr_reads_are_kept_and_the_others_checked() -> None:
    obj = service_dict()
    obj["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": "kpr", "app": "web"}
    assert parse_service(obj).labels == {"service.kubernetes.io/service-proxy-name": "kpr"}
    obj["metadata"]["labels"] = {"app": "web"}
    assert parse_service(obj).labels == {}
    obj["metadata"]["labels"] = {"app": 7}
    assert error_of(parse_service, obj).field == "metadata.labels[app]"


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ({"clusterIP": "10.96.0.300"}, "spec.clusterIP", "not a valid IP address"),
        ({"clusterIPs": ["10.96.0.1", "nope"]}, "spec.clusterIPs[1]", "not a valid IP address"),
        ({"clusterIPs": ["10.96.0.1", "10.96.0.2"]}, "spec.clusterIPs[1]", "other IP family"),
        ({"clusterIPs": ["10.96.0.2"]}, "spec.clusterIP", "differs from spec.clusterIPs[0]"),
        ({"externalIPs": ["192.0.2.1", "x"]}, "spec.externalIPs[1]", "not a valid IP address"),
        ({"externalIPs": "192.0.2.1"}, "spec.externalIPs", "must be a list"),
        ({"ports": [{"port": 0}]}, "spec.ports[0].port", "0 is not a valid port (1-65535)"),
        (
            {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 65536}]},
            "spec.ports[1].port",
            "65536 is not a valid port (1-65535)",
        ),
        ({"ports": [{"port": 80, "nodePort": 0}]}, "spec.ports[0].nodePort", "not a valid port"),
        ({"ports": [{"port": 80, "nodePort": 70000}]}, "spec.ports[0].nodePort", "valid port"),
        ({"ports": [{"port": "80"}]}, "spec.ports[0].port", "must be an integer"),
        ({"ports": [{"port": True}]}, "spec.ports[0].port", "must be an integer"),
        ({"ports": [{}]}, "spec.ports[0].port", "must be an integer"),
        ({"ports": [{"port": 80, "protocol": "ICMP"}]}, "spec.ports[0].protocol", "'ICMP'"),
        ({"ports": [{"port": 80, "protocol": "tcp"}]}, "spec.ports[0].protocol", "TCP, UDP, SCTP"),
        ({"ports": {"port": 80}}, "spec.ports", "must be a list, not dict"),
        ({"ports": [80]}, "spec.ports[0]", "must be a mapping"),
        ({"ports": [{"port": 80}, {"port": 81}]}, "spec.ports[1].name", "unique names"),
        (
            {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]},
            "spec.ports[1].port",
            "80/TCP is also spec.ports[0]",
        ),
        ({"type": "Ingress"}, "spec.type", "'Ingress' is not one of"),
        ({"sessionAffinity": "Cookie"}, "spec.sessionAffinity", "'Cookie'"),
        (
            {"sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 0}}},
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            "between 1 and 86400",
        ),
        ({"internalTrafficPolicy": "Node"}, "spec.internalTrafficPolicy", "'Node'"),
    ],
)
def test_invalid_service_field_is_an_error_naming_the_field(
    spec: dict[str, Any], field: str, message: str
) -> None:
    error = error_of(parse_service, service_dict(**spec))
    assert error.ref == ObjectRef("Service", "shop", "web")
    assert error.field == field
    assert message in error.message


def test_error_message_names_object_and_field_path() -> None:
    obj = service_dict(ports=[{"name": "a", "port": 80}, {"name": "b", "port": 65536}])
    assert str(error_of(parse_service, obj)) == (
        "Service shop/web: spec.ports[1].port: 65536 is not a valid port (1-65535)"
    )


def test_object_error_is_a_value_error() -> None:
    assert issubclass(ObjectError, ValueError)


@pytest.mark.parametrize("metadata", [{}, {"name": ""}, {"name": 7}, None])
def test_missing_name_is_an_error(metadata: dict[str, Any] | None) -> None:
    obj = service_dict()
    obj["metadata"] = metadata
    error = error_of(parse_service, obj)
    assert error.ref is None
    assert error.field == "metadata.name"
    assert str(error) == "metadata.name: a Service must have a name"


def test_label_values_must_be_strings() -> None:
    obj = service_dict()
    obj["metadata"]["labels"] = {"version": 2}
    assert error_of(parse_service, obj).field == "metadata.labels[version]"


def test_spec_of_the_wrong_type_is_an_error() -> None:
    obj = service_dict()
    obj["spec"] = ["clusterIP"]
    assert error_of(parse_service, obj).field == "spec"


# --- EndpointSlice -----------------------------------------------------------------


def test_endpoint_conditions_default_ready_serving_not_terminating() -> None:
    endpoint_slice = parse_endpoint_slice(slice_dict())
    assert endpoint_slice.endpoints == (
        Endpoint(
            ip=address_value(ip_address("10.244.0.5")), ready=True, serving=True, terminating=False
        ),
    )


def test_slice_reads_owner_ports_conditions_node_zone_and_hints() -> None:
    endpoint_slice = parse_endpoint_slice(
        slice_dict(
            endpoints=[
                {
                    "addresses": ["10.244.0.5", "10.244.0.6"],
                    "conditions": {"ready": False, "serving": True, "terminating": True},
                    "nodeName": "node-1",
                    "zone": "zone-a",
                    "hints": {"forNodes": [{"name": "node-1"}], "forZones": [{"name": "zone-a"}]},
                }
            ],
            ports=[{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns"}],
        )
    )
    assert endpoint_slice.service_name == "web"
    assert endpoint_slice.address_type == "IPv4"
    assert endpoint_slice.ports == (
        EndpointPort("http", "TCP", 8080),
        EndpointPort("dns", "TCP", None),
    )
    assert endpoint_slice.endpoints == (
        Endpoint(
            ip=address_value(ip_address("10.244.0.5")),  # the first: the one kube-proxy uses
            ready=False,
            serving=True,
            terminating=True,
            node_name="node-1",
            zone="zone-a",
            hints_for_nodes=("node-1",),
            hints_for_zones=("zone-a",),
        ),
    )


def test_null_conditions_take_their_defaults() -> None:
    endpoint = {"addresses": ["10.244.0.5"], "conditions": {"ready": None, "terminating": None}}
    (parsed,) = parse_endpoint_slice(slice_dict(endpoints=[endpoint])).endpoints
    assert (parsed.ready, parsed.serving, parsed.terminating) == (True, True, False)


def test_slice_without_service_name_label_has_no_owner() -> None:
    obj = slice_dict()
    obj["metadata"]["labels"] = {}
    assert parse_endpoint_slice(obj).service_name is None


def test_null_endpoints_and_ports_are_empty() -> None:
    obj = slice_dict()
    obj["endpoints"] = None
    obj["ports"] = None
    endpoint_slice = parse_endpoint_slice(obj)
    assert endpoint_slice.endpoints == ()
    assert endpoint_slice.ports == ()


def test_ipv6_slice_reads_ipv6_addresses() -> None:
    obj = slice_dict(endpoints=[{"addresses": ["fd00:244::5"]}], address_type="IPv6")
    (endpoint,) = parse_endpoint_slice(obj).endpoints
    assert endpoint.address == ip_address("fd00:244::5")


def test_fqdn_slice_is_read_without_its_host_names() -> None:
    obj = slice_dict(endpoints=[{"addresses": ["db.example.com"]}], address_type="FQDN")
    endpoint_slice = parse_endpoint_slice(obj)
    assert (endpoint_slice.address_type, endpoint_slice.endpoints) == ("FQDN", ())


@pytest.mark.parametrize(
    ("obj", "field", "message"),
    [
        (
            slice_dict(endpoints=[{"addresses": ["fd00::1"]}]),
            "endpoints[0].addresses[0]",
            "'fd00::1' is not an IPv4 address",
        ),
        (
            slice_dict(endpoints=[{"addresses": ["10.0.0.1"]}], address_type="IPv6"),
            "endpoints[0].addresses[0]",
            "not an IPv6 address",
        ),
        (
            slice_dict(endpoints=[{"addresses": ["10.0.0.1", "10.0.0.x"]}]),
            "endpoints[0].addresses[1]",
            "not a valid IP address",
        ),
        (
            slice_dict(endpoints=[{"addresses": ["fe80::1%eth0"]}], address_type="IPv6"),
            "endpoints[0].addresses[0]",
            "not a valid IP address",
        ),
        (slice_dict(endpoints=[{"addresses": []}]), "endpoints[0].addresses", "at least one"),
        (slice_dict(endpoints=[{}]), "endpoints[0].addresses", "at least one"),
        (slice_dict(ports=[{"port": 0}]), "ports[0].port", "0 is not a valid port (1-65535)"),
        (slice_dict(ports=[{"port": 65536}]), "ports[0].port", "65536 is not a valid port"),
        (slice_dict(ports=[{"port": 80, "protocol": "GRE"}]), "ports[0].protocol", "'GRE'"),
        (slice_dict(ports={"port": 80}), "ports", "must be a list"),
        (slice_dict(address_type="IPv5"), "addressType", "'IPv5' is not one of"),
        (
            slice_dict(endpoints=[{"addresses": ["10.0.0.1"], "conditions": {"ready": "yes"}}]),
            "endpoints[0].conditions.ready",
            "must be true or false",
        ),
        (
            slice_dict(endpoints=[{"addresses": ["10.0.0.1"], "hints": {"forZones": [{}]}}]),
            "endpoints[0].hints.forZones[0].name",
            "non-empty string",
        ),
        (
            slice_dict(endpoints=[{"addresses": ["10.0.0.1"], "nodeName": 3}]),
            "endpoints[0].nodeName",
            "must be a string",
        ),
    ],
)
def test_invalid_slice_field_is_an_error_naming_the_field(
    obj: dict[str, Any], field: str, message: str
) -> None:
    error = error_of(parse_endpoint_slice, obj)
    assert error.ref == ObjectRef("EndpointSlice", "shop", "web-abc12")
    assert error.field == field
    assert message in error.message


def test_missing_address_type_is_an_error() -> None:
    obj = slice_dict()
    del obj["addressType"]
    assert error_of(parse_endpoint_slice, obj).field == "addressType"


# --- dispatch ------------------------------------------------------------------------


def test_parse_object_dispatches_on_api_version_and_kind() -> None:
    assert parse_object(service_dict()).ref == ObjectRef("Service", "shop", "web")
    assert parse_object(slice_dict()).ref == ObjectRef("EndpointSlice", "shop", "web-abc12")


@pytest.mark.parametrize(
    ("api_version", "kind"),
    [
        ("v1", "ConfigMap"),
        ("v1", "Endpoints"),
        ("discovery.k8s.io/v1beta1", "EndpointSlice"),
        ("v2", "Service"),
        (None, None),
    ],
)
def test_other_kinds_are_not_parsed(api_version: str | None, kind: str | None) -> None:
    assert parse_object({"apiVersion": api_version, "kind": kind, "metadata": {}}) is None


def test_parse_object_raises_for_an_invalid_service() -> None:
    with pytest.raises(ObjectError):
        parse_object(service_dict(clusterIP="bogus"))


def test_load_balancer_status_ips_except_proxy_mode_source_ranges_and_health_port() -> None:
    obj = service_dict(
        type="LoadBalancer",
        loadBalancerSourceRanges=[" 198.51.100.0/24", "2001:db8::/32"],
        healthCheckNodePort=32100,
    )
    obj["status"] = {
        "loadBalancer": {
            "ingress": [
                {"ip": "203.0.113.7"},
                {"ip": "203.0.113.8", "ipMode": "Proxy"},
                {"hostname": "lb.example.com"},
                {"ip": "203.0.113.9", "ipMode": "VIP"},
            ]
        }
    }
    service = parse_service(obj)
    assert service.load_balancer_ips == (ip_address("203.0.113.7"), ip_address("203.0.113.9"))
    assert [str(r) for r in service.load_balancer_source_ranges] == [
        "198.51.100.0/24",
        "2001:db8::/32",
    ]
    assert service.health_check_node_port == 32100


@pytest.mark.parametrize(
    ("spec", "status", "field"),
    [
        ({"loadBalancerSourceRanges": ["10.0.0.0/33"]}, {}, "spec.loadBalancerSourceRanges[0]"),
        ({"healthCheckNodePort": 70000}, {}, "spec.healthCheckNodePort"),
        (
            {},
            {"loadBalancer": {"ingress": [{"ip": "300.1.1.1"}]}},
            "status.loadBalancer.ingress[0].ip",
        ),
        (
            {},
            {"loadBalancer": {"ingress": [{"ip": "1.1.1.1", "ipMode": "X"}]}},
            "status.loadBalancer.ingress[0].ipMode",
        ),
    ],
)
def test_bad_load_balancer_fields_name_the_field(spec, status, field) -> None:
    obj = service_dict(type="LoadBalancer", **spec)
    obj["status"] = status
    assert error_of(parse_service, obj).field == field


_CONDITION = st.sampled_from([None, True, False, "yes", 1, 0])
_NAME = st.sampled_from([None, "node-1", "node-2", "", 3])


@st.composite
def endpoint_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """Endpoints of every shape the API sends and some it should not: the common one and
    every way off it (a second address, unknown or null conditions, hints, bad types)."""
    n = draw(st.integers(0, 255))
    endpoint: dict[str, Any] = {
        "addresses": draw(
            st.sampled_from(
                [[f"10.0.0.{n}"], [f"10.0.0.{n}", "10.0.1.1"], [f"fd00::{n:x}"], [], "10.0.0.1"]
            )
        )
    }
    if draw(st.booleans()):
        names = draw(st.sets(st.sampled_from(["ready", "serving", "terminating", "other"])))
        endpoint["conditions"] = {c: draw(_CONDITION) for c in names}
    elif draw(st.booleans()):
        endpoint["conditions"] = None
    for key in ("nodeName", "zone"):
        if draw(st.booleans()):
            endpoint[key] = draw(_NAME)
    if draw(st.integers(0, 4)) == 0:
        endpoint["hints"] = draw(st.sampled_from([None, {"forZones": [{"name": "a"}]}, {}]))
    return endpoint


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(endpoint_dicts(), max_size=6), st.sampled_from(["IPv4", "IPv6"]))
def test_the_quick_reading_of_endpoints_equals_the_field_by_field_one(
    endpoints: list[dict[str, Any]], address_type: str
) -> None:
    """A slice's endpoints are read quickly when they have the common shape: the same
    endpoints, or the same error naming the same field, as reading each field does."""
    version = 4 if address_type == "IPv4" else 6
    ref = ObjectRef("EndpointSlice", "shop", "web-abc12")
    try:
        expected = [_endpoint(e, ref, f"endpoints[{i}]", version) for i, e in enumerate(endpoints)]
    except ObjectError as error:
        got = error_of(parse_endpoint_slice, slice_dict(endpoints, address_type))
        assert (got.field, got.message) == (error.field, error.message)
        return
    parsed = parse_endpoint_slice(slice_dict(endpoints, address_type)).endpoints
    assert list(parsed) == expected
    assert parsed == Endpoints(expected) and hash(parsed) == hash(Endpoints(expected))


_ODD = st.sampled_from([None, "", 3, True, [], {}, "x"])


@st.composite
def slice_variants(draw: st.DrawFn) -> dict[str, Any]:
    """EndpointSlices with the common shape and every way off it in their own fields
    (metadata, addressType, ports), some valid and some not."""
    common = [{"addresses": ["10.0.0.1"], "nodeName": "node-1"}]
    obj = slice_dict(draw(st.one_of(st.just(common), st.lists(endpoint_dicts(), max_size=3))))
    metadata = obj["metadata"]
    for key, good in (("name", "web-abc12"), ("namespace", "shop")):
        if draw(st.integers(0, 3)) == 0:
            metadata[key] = draw(_ODD)
        elif draw(st.booleans()):
            metadata[key] = good
    if draw(st.integers(0, 3)) == 0:
        metadata["labels"] = draw(
            st.sampled_from([None, {}, {"kubernetes.io/service-name": 3}, {"a": "b"}, "x"])
        )
    if draw(st.integers(0, 3)) == 0:
        metadata["annotations"] = draw(
            st.sampled_from(
                [
                    None,
                    {"endpoints.kubernetes.io/last-change-trigger-time": "2026-12-07T10:00:00Z"},
                    {"endpoints.kubernetes.io/last-change-trigger-time": "soon"},
                    {"endpoints.kubernetes.io/last-change-trigger-time": 5},
                    [],
                ]
            )
        )
    if draw(st.integers(0, 3)) == 0:
        obj["addressType"] = draw(st.sampled_from(["IPv6", "FQDN", "ipv4", None, 4]))
    if draw(st.booleans()):
        port: dict[str, Any] = {}
        for key, values in (
            ("name", [None, "", "http", 3]),
            ("port", [None, 0, 80, 65535, 65536, "80", True, 8.5]),
            ("protocol", [None, "", "TCP", "UDP", "SCTP", "tcp", 6]),
        ):
            if draw(st.booleans()):
                port[key] = draw(st.sampled_from(values))
        obj["ports"] = draw(st.sampled_from([[port], [port, {"name": "b", "port": 9}], None]))
    return obj


@st.composite
def service_variants(draw: st.DrawFn) -> dict[str, Any]:
    """Services of the common shape and every way off it, valid and not."""
    obj = service_dict()
    spec, metadata = obj["spec"], obj["metadata"]
    if draw(st.integers(0, 3)) == 0:
        metadata["name"] = draw(_ODD)
    if draw(st.integers(0, 3)) == 0:
        metadata["labels"] = draw(
            st.sampled_from([None, {"service.kubernetes.io/service-proxy-name": "x"}, {"a": 1}])
        )
    choices: dict[str, list[Any]] = {
        "type": [None, "ClusterIP", "NodePort", "LoadBalancer", "ExternalName", "", "x", 3],
        "clusterIP": [None, "", "None", "10.96.0.9", "fd00::9", "10.96.0.300", 5],
        "clusterIPs": [None, [], ["10.96.0.9"], ["10.96.0.9", "fd00::9"], ["None"], ["x"]],
        "externalIPs": [None, [], ["192.0.2.1"], "x", 0, ""],
        "sessionAffinity": [None, "None", "ClientIP", "", "x"],
        "sessionAffinityConfig": [None, {}, {"clientIP": {"timeoutSeconds": 60}}],
        "internalTrafficPolicy": [None, "Cluster", "Local", "", "x"],
        "externalTrafficPolicy": [None, "Cluster", "Local", ""],
        "loadBalancerSourceRanges": [None, [], ["10.0.0.0/8"], 0],
        "healthCheckNodePort": [None, 32000, 0, "x"],
    }
    for key, values in choices.items():  # (a few at a time: the others stay common)
        if draw(st.integers(0, 5)) == 0:
            spec[key] = draw(st.sampled_from(values))
    if draw(st.booleans()):
        ports = []
        for _ in range(draw(st.integers(0, 3))):
            port: dict[str, Any] = {}
            for key, values in (
                ("name", [None, "", "http", "dns", 3]),
                ("port", [None, 0, 80, 53, 65536, "80", True]),
                ("protocol", [None, "", "TCP", "UDP", "tcp"]),
                ("nodePort", [None, 0, 30080, 70000]),
            ):
                if draw(st.booleans()):
                    port[key] = draw(st.sampled_from(values))
            ports.append(port)
        spec["ports"] = ports
    if draw(st.booleans()):
        obj["status"] = draw(
            st.sampled_from(
                [
                    None,
                    {},
                    {"loadBalancer": {}},
                    {"loadBalancer": {"ingress": []}},
                    {"loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}},
                    {"loadBalancer": None},
                    {"loadBalancer": []},
                    [],
                ]
            )
        )
    return obj


@settings(
    max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.one_of(slice_variants(), service_variants(), service_variants()))
def test_a_list_page_gives_the_objects_and_errors_a_watch_event_gives(obj: dict[str, Any]) -> None:
    """The agent lists Services and EndpointSlices decoded into structs and watches them
    as dicts: the same object, or the same error naming the same field, either way."""
    parse = objects.parse_service if obj["kind"] == "Service" else objects.parse_endpoint_slice
    try:
        expected = parse(obj)
    except ObjectError as error:
        with pytest.raises(ObjectError) as caught:
            via_list_page(obj)
        assert (caught.value.ref, caught.value.field, caught.value.message) == (
            error.ref,
            error.field,
            error.message,
        )
        return
    assert via_list_page(obj) == expected


@settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.ip_addresses().map(str),
        st.ip_addresses(v=6).map(lambda a: a.exploded),
        st.text(alphabet="0123456789abcdef:.%x ", min_size=1, max_size=24),
    )
)
def test_addresses_are_read_as_the_ipaddress_module_reads_them(text: str) -> None:
    """Service addresses are parsed by the C library: the same addresses, and the same
    strings refused, as Python's ipaddress module (a zone never accepted)."""
    try:
        expected = None if "%" in text else ip_address(text)
    except ValueError:
        expected = None
    service = service_dict(clusterIP=text)
    if expected is None:
        assert error_of(parse_service, service).field == "spec.clusterIP"
    else:
        assert parse_service(service).cluster_ips == (expected,)


@pytest.mark.parametrize("decode", [decode_service_page, decode_slice_page])
def test_a_list_page_cut_short_is_an_error_not_a_list_of_nothing(decode):
    # (the watcher lists again; an empty list would take every Service off the maps)
    with pytest.raises(ValueError):
        decode(b'{"kind":"List","metadata":{"resourceVersion":"7"},"items":[{"metadata":')
