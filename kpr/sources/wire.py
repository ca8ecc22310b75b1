"""List pages decoded straight into typed structs (msgspec): what kpr reads of an
EndpointSlice and nothing more, without a dict for each endpoint (a large cluster lists a
million), then made into kpr.model objects.

The validating path (kpr/sources/objects.py, on dicts) stays the one source of the rules
and of their errors: a page a struct does not fit (a field of the wrong type) is decoded
into dicts and parsed there, and so is an object of any but the common shape, from its
struct (`msgspec.to_builtins`: the fields kpr reads, as the page had them). The two paths
give equal objects and equal errors (tests/unit/sources/test_objects.py runs every case
through both).
"""

from __future__ import annotations

import socket
import sys
from itertools import product
from typing import Any

import msgspec
import orjson

from kpr.model import EndpointPort, Endpoints, EndpointSlice, conditions_of
from kpr.sources.objects import (
    ADDRESS_TYPES,
    SERVICE_NAME_LABEL,
    SERVICE_PROTOCOLS,
    TRIGGER_TIME_ANNOTATION,
    parse_endpoint_slice,
    trigger_time,
)


class _Struct(msgspec.Struct, omit_defaults=True):
    """A missing field and a null one are alike (None), as the validating path reads
    them; `to_builtins` leaves both out."""


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


class _ListMetadata(_Struct):
    resource_version: str | None = msgspec.field(default=None, name="resourceVersion")
    continue_: str | None = msgspec.field(default=None, name="continue")


class _EndpointSliceList(_Struct):
    metadata: _ListMetadata | None = None
    items: list[_EndpointSlice] | None = None


_SLICE_LIST = msgspec.json.Decoder(_EndpointSliceList)

# conditions_of for each (ready, serving, terminating) as the API sends them: true,
# false or unset (the validating path reads them alike)
_CONDITIONS = {
    (ready, serving, terminating): conditions_of(
        ready is not False, serving is not False, terminating is True
    )
    for ready, serving, terminating in product((True, False, None), repeat=3)
}
_FAMILIES = {"IPv4": (socket.AF_INET, 4, b""), "IPv6": (socket.AF_INET6, 17, b"\x01")}


def decode_slice_page(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """A page of an EndpointSlice list: (its list metadata, its items), the items as
    structs for `parse_listed_slice`, or as dicts where the page does not fit them."""
    try:
        page = _SLICE_LIST.decode(data)
    except msgspec.DecodeError:  # (and ValidationError) the dicts' path, and its errors
        body = orjson.loads(data)
        return body.get("metadata") or {}, body.get("items") or []
    metadata = page.metadata or _ListMetadata()
    listed = {"resourceVersion": metadata.resource_version, "continue": metadata.continue_}
    return listed, page.items or []


def parse_listed_slice(item: Any) -> EndpointSlice:
    """An item of `decode_slice_page`, validated (ObjectError as `parse_endpoint_slice`)."""
    if isinstance(item, _EndpointSlice):
        parsed = _common_slice(item)
        if parsed is not None:
            return parsed
        item = msgspec.to_builtins(item)
    return parse_endpoint_slice(item)


def listed_name(item: Any) -> tuple[Any, Any]:
    """(metadata.namespace, metadata.name) of a struct item, as the page had them."""
    metadata = item.metadata
    return (None, None) if metadata is None else (metadata.namespace, metadata.name)


def _common_slice(item: _EndpointSlice) -> EndpointSlice | None:
    """The slice, when it has the common shape (IPv4 or IPv6, every endpoint with one
    address and no hints, names and labels as strings, ports in range); None: any other,
    for the validating path (which names the field of an error)."""
    metadata = item.metadata
    if metadata is None or type(metadata.name) is not str or not metadata.name:
        return None
    namespace, labels = metadata.namespace, metadata.labels
    if (namespace is not None and type(namespace) is not str) or (
        labels is not None
        and (type(labels) is not dict or any(type(v) is not str for v in labels.values()))
    ):
        return None
    family = _FAMILIES.get(item.address_type)  # (not FQDN: rare, left to the other path)
    ports = _common_ports(item.ports or ())
    if family is None or ports is None:
        return None
    endpoints = _common_endpoints(item.endpoints or (), *family)
    if endpoints is None:
        return None
    annotations = metadata.annotations
    return EndpointSlice(
        namespace=sys.intern(namespace or "default"),
        name=metadata.name,
        service_name=labels.get(SERVICE_NAME_LABEL) if labels else None,
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
        number = port.port
        protocol = "TCP" if port.protocol is None else port.protocol
        if (number is not None and not 1 <= number <= 65535) or protocol not in SERVICE_PROTOCOLS:
            return None
        name = sys.intern(port.name) if port.name else ""
        protocol = SERVICE_PROTOCOLS[SERVICE_PROTOCOLS.index(protocol)]
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
