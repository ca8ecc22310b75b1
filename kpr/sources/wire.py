"""List pages decoded straight into typed structs (msgspec): what kpr reads of a Service or
an EndpointSlice and nothing more, without a dict for each endpoint (a large cluster lists
a million), then made into kpr.model objects.

The validating path (kpr/sources/objects.py, on dicts) stays the one source of the rules
and of their errors: a page a struct does not fit (a field of the wrong type) is decoded
into dicts and parsed there, and so is an object of any but the common shape, from its
struct (`msgspec.to_builtins`: the fields kpr reads, as the page had them). The two paths
give equal objects and equal errors (tests/unit/sources/test_objects.py runs every case
through both). The common path never raises: whatever it doubts, it leaves to the other,
whose first error is the one to report.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from itertools import product
from typing import Any, TypeVar

import msgspec
import orjson

from kpr.model import (
    EndpointPort,
    Endpoints,
    EndpointSlice,
    IPAddress,
    Service,
    ServicePort,
    conditions_of,
)
from kpr.sources.objects import (
    ADDRESS_TYPES,
    DEFAULT_AFFINITY_TIMEOUT,
    NO_LABELS,
    SERVICE_NAME_LABEL,
    SERVICE_PROTOCOLS,
    SERVICE_TYPES,
    SESSION_AFFINITIES,
    TRAFFIC_POLICIES,
    TRIGGER_TIME_ANNOTATION,
    kept_labels,
    packed_ip,
    parse_endpoint_slice,
    parse_service,
    trigger_time,
)


class _Struct(msgspec.Struct, omit_defaults=True):
    """A missing field and a null one are alike (None), as the validating path reads
    them; `to_builtins` leaves both out."""


S = TypeVar("S", bound=_Struct)
T = TypeVar("T")


class _Metadata(_Struct):
    name: Any = None
    namespace: Any = None
    labels: Any = None
    annotations: Any = None


class _Conditions(_Struct):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class _Endpoint(_Struct):
    addresses: list[str] | None = None
    conditions: _Conditions | None = None
    node_name: str | None = msgspec.field(default=None, name="nodeName")
    zone: str | None = None
    hints: Any = None  # (rare: read by the validating path)


class _EndpointPort(_Struct):
    name: str | None = None
    protocol: str | None = None
    port: int | None = None


class _EndpointSlice(_Struct):
    metadata: _Metadata | None = None
    address_type: Any = msgspec.field(default=None, name="addressType")
    ports: list[_EndpointPort] | None = None
    endpoints: list[_Endpoint] | None = None


class _ServicePort(_Struct):
    name: str | None = None
    protocol: str | None = None
    port: int | None = None
    node_port: int | None = msgspec.field(default=None, name="nodePort")


class _ServiceSpec(_Struct):
    type: Any = None
    cluster_ip: str | None = msgspec.field(default=None, name="clusterIP")
    cluster_ips: list[str] | None = msgspec.field(default=None, name="clusterIPs")
    ports: list[_ServicePort] | None = None
    external_ips: Any = msgspec.field(default=None, name="externalIPs")
    session_affinity: Any = msgspec.field(default=None, name="sessionAffinity")
    session_affinity_config: Any = msgspec.field(default=None, name="sessionAffinityConfig")
    internal_traffic_policy: Any = msgspec.field(default=None, name="internalTrafficPolicy")
    external_traffic_policy: Any = msgspec.field(default=None, name="externalTrafficPolicy")
    load_balancer_source_ranges: Any = msgspec.field(default=None, name="loadBalancerSourceRanges")
    health_check_node_port: Any = msgspec.field(default=None, name="healthCheckNodePort")


class _Service(_Struct):
    metadata: _Metadata | None = None
    spec: _ServiceSpec | None = None
    status: Any = None


class _ListMetadata(_Struct):
    resource_version: str | None = msgspec.field(default=None, name="resourceVersion")
    continue_: str | None = msgspec.field(default=None, name="continue")


class _ServiceList(_Struct):
    metadata: _ListMetadata | None = None
    items: list[_Service] | None = None


class _EndpointSliceList(_Struct):
    metadata: _ListMetadata | None = None
    items: list[_EndpointSlice] | None = None


_SERVICE_LIST = msgspec.json.Decoder(_ServiceList)
_SLICE_LIST = msgspec.json.Decoder(_EndpointSliceList)

# conditions_of for each (ready, serving, terminating) as the API sends them: true,
# false or unset (the validating path reads them alike)
_CONDITIONS = {
    (ready, serving, terminating): conditions_of(
        ready is not False, serving is not False, terminating is True
    )
    for ready, serving, terminating in product((True, False, None), repeat=3)
}
_ADDRESS_TYPES = {"IPv4": (socket.AF_INET, 4, b""), "IPv6": (socket.AF_INET6, 17, b"\x01")}


def decode_service_page(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """A page of a Service list: (its list metadata, its items), the items as structs
    for `parse_listed_service`, or as dicts where the page does not fit them."""
    return _decode(_SERVICE_LIST, data)


def decode_slice_page(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """A page of an EndpointSlice list, as `decode_service_page`."""
    return _decode(_SLICE_LIST, data)


def _decode(decoder: msgspec.json.Decoder, data: bytes) -> tuple[dict[str, Any], list[Any]]:
    try:
        page = decoder.decode(data)
    except msgspec.DecodeError:  # (and ValidationError) the dicts' path, and its errors
        body = orjson.loads(data)
        return body.get("metadata") or {}, body.get("items") or []
    metadata = page.metadata or _ListMetadata()
    listed = {"resourceVersion": metadata.resource_version, "continue": metadata.continue_}
    return listed, page.items or []


def parse_listed_service(item: Any) -> Service:
    """An item of `decode_service_page`, validated (ObjectError as `parse_service`)."""
    return _parsed(item, _Service, _common_service, parse_service)


def parse_listed_slice(item: Any) -> EndpointSlice:
    """An item of `decode_slice_page`, validated (ObjectError as `parse_endpoint_slice`)."""
    return _parsed(item, _EndpointSlice, _common_slice, parse_endpoint_slice)


def _parsed(
    item: Any,
    struct: type[S],
    common: Callable[[S], T | None],
    parse: Callable[[dict[str, Any]], T],
) -> T:
    """By the common path where it can, else by the validating one (a watch event's
    dict; or a struct's fields, as the page had them)."""
    if isinstance(item, struct):
        parsed = common(item)
        if parsed is not None:
            return parsed
        item = msgspec.to_builtins(item)
    return parse(item)


def listed_name(item: Any) -> tuple[Any, Any]:
    """(metadata.namespace, metadata.name) of a struct item, as the page had them."""
    metadata = item.metadata
    return (None, None) if metadata is None else (metadata.namespace, metadata.name)


def _common_metadata(metadata: _Metadata | None) -> tuple[str, str, Any] | None:
    """(namespace, name, the labels kpr keeps) of metadata of the common shape."""
    if metadata is None or type(metadata.name) is not str or not metadata.name:
        return None
    namespace, labels = metadata.namespace, metadata.labels
    if namespace is not None and type(namespace) is not str:
        return None
    kept = NO_LABELS
    if labels is not None:
        if type(labels) is not dict or any(type(v) is not str for v in labels.values()):
            return None
        kept = kept_labels(labels)
    return sys.intern(namespace or "default"), metadata.name, kept


def _common_service(item: _Service) -> Service | None:
    """The Service, when it has the common shape (no external IPs, load balancer
    status, source ranges, health check port or affinity config; one cluster IP or
    none; its fields valid); None: any other, for the validating path."""
    named, spec = _common_metadata(item.metadata), item.spec
    if named is None or spec is None or not _no_extras(spec, item.status):
        return None
    kind = "ClusterIP" if spec.type is None else spec.type
    affinity = "None" if spec.session_affinity is None else spec.session_affinity
    internal, external = spec.internal_traffic_policy, spec.external_traffic_policy
    internal = "Cluster" if internal is None else internal
    external = "Cluster" if external is None else external
    if (
        kind not in SERVICE_TYPES
        or affinity not in SESSION_AFFINITIES
        or internal not in TRAFFIC_POLICIES
        or external not in TRAFFIC_POLICIES
    ):
        return None
    ports = _common_service_ports(spec.ports or ())
    cluster_ips = _common_cluster_ips(spec)
    if ports is None or cluster_ips is None:
        return None
    namespace, name, labels = named
    return Service(
        namespace=namespace,
        name=name,
        type=SERVICE_TYPES[SERVICE_TYPES.index(kind)],
        cluster_ips=cluster_ips,
        ports=ports,
        labels=labels,
        session_affinity=SESSION_AFFINITIES[SESSION_AFFINITIES.index(affinity)],
        affinity_timeout=DEFAULT_AFFINITY_TIMEOUT,
        internal_traffic_policy=TRAFFIC_POLICIES[TRAFFIC_POLICIES.index(internal)],
        external_traffic_policy=TRAFFIC_POLICIES[TRAFFIC_POLICIES.index(external)],
    )


def _no_extras(spec: _ServiceSpec, status: Any) -> bool:
    """Nothing of what the common path leaves to the validating one: every field empty
    as the API leaves it (null or missing, an empty list, an empty load balancer)."""
    if (
        spec.external_ips not in (None, [])
        or spec.load_balancer_source_ranges not in (None, [])
        or spec.health_check_node_port is not None
        or spec.session_affinity_config is not None
    ):
        return False
    if status is None:
        return True
    if type(status) is not dict:
        return False
    balancer = status.get("loadBalancer")
    return balancer is None or (type(balancer) is dict and balancer.get("ingress") in (None, []))


def _common_port(port: Any) -> tuple[str, str] | None:
    """(name, protocol) of a Service's or a slice's port whose protocol is valid, as
    the shared strings; None: not valid (the other path's error)."""
    protocol = "TCP" if port.protocol is None else port.protocol
    if protocol not in SERVICE_PROTOCOLS:
        return None
    name = sys.intern(port.name) if port.name else ""
    return name, SERVICE_PROTOCOLS[SERVICE_PROTOCOLS.index(protocol)]


def _in_range(number: int | None) -> bool:
    return number is None or 1 <= number <= 65535


def _common_service_ports(ports: Any) -> tuple[ServicePort, ...] | None:
    out = []
    for port in ports:
        number, node_port = port.port, port.node_port
        common = _common_port(port)
        if number is None or not _in_range(number) or not _in_range(node_port) or not common:
            return None
        name, protocol = common
        out.append(ServicePort(name=name, protocol=protocol, port=number, node_port=node_port))
    # names and port/protocol pairs unique (else the other path's error)
    if len({p.name for p in out}) < len(out) or len({(p.port, p.protocol) for p in out}) < len(out):
        return None
    return tuple(out)


def _common_cluster_ips(spec: _ServiceSpec) -> tuple[IPAddress, ...] | None:
    """spec.clusterIPs (or clusterIP) when it is one address, or none (headless)."""
    cluster_ip, values = spec.cluster_ip or "", spec.cluster_ips or []
    if values and cluster_ip and cluster_ip != values[0]:
        return None
    values = values or ([cluster_ip] if cluster_ip else [])
    if not values or values[0] in ("None", ""):
        return ()
    if len(values) != 1:
        return None  # (dual-stack: the other path checks the families)
    address = packed_ip(values[0])
    return None if address is None else (address,)


def _common_slice(item: _EndpointSlice) -> EndpointSlice | None:
    """The slice, when it has the common shape (IPv4 or IPv6, every endpoint with one
    address and no hints, names and labels as strings, ports in range); None: any other,
    for the validating path (which names the field of an error)."""
    named = _common_metadata(item.metadata)
    if named is None:
        return None
    family = _ADDRESS_TYPES.get(item.address_type)  # (not FQDN: rare, left to the other path)
    ports = _common_ports(item.ports or ())
    if family is None or ports is None:
        return None
    endpoints = _common_endpoints(item.endpoints or (), *family)
    if endpoints is None:
        return None
    namespace, name, labels = named
    annotations = item.metadata.annotations  # type: ignore[union-attr]
    return EndpointSlice(
        namespace=namespace,
        name=name,
        service_name=labels.get(SERVICE_NAME_LABEL),
        address_type=ADDRESS_TYPES[ADDRESS_TYPES.index(item.address_type)],
        ports=ports,
        endpoints=endpoints,
        trigger_time=trigger_time(annotations.get(TRIGGER_TIME_ANNOTATION))
        if type(annotations) is dict
        else None,
    )


def _common_ports(ports: Any) -> tuple[EndpointPort, ...] | None:
    out = []
    for port in ports:
        number, common = port.port, _common_port(port)
        if not _in_range(number) or not common:
            return None
        name, protocol = common
        out.append(EndpointPort(name=name, protocol=protocol, port=number))
    return tuple(out)


def _common_endpoints(endpoints: Any, family: int, width: int, prefix: bytes) -> Endpoints | None:
    ips, conditions = bytearray(), bytearray()
    places: list[tuple[str | None, str | None]] = []
    conditions_of_api = _CONDITIONS
    for endpoint in endpoints:
        addresses = endpoint.addresses
        if endpoint.hints is not None or addresses is None or len(addresses) != 1:
            return None
        try:
            ips += prefix + socket.inet_pton(family, addresses[0])
        except OSError:
            return None
        given = endpoint.conditions
        conditions.append(
            conditions_of_api[True, True, None]
            if given is None
            else conditions_of_api[given.ready, given.serving, given.terminating]
        )
        node, zone = endpoint.node_name, endpoint.zone
        places.append(
            (None if node is None else sys.intern(node), None if zone is None else sys.intern(zone))
        )
    return Endpoints.packed(bytes(ips), width, bytes(conditions), places, [])
