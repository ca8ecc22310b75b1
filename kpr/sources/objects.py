"""Validation of API-shaped Kubernetes objects into the dataclasses of kpr.model.

Input is what the API server (or `kubectl get -o yaml`) gives: camelCase dicts.
Everything kpr relies on is checked here, so translation can trust its input;
a bad field raises ObjectError naming the object and the field path.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Mapping
from datetime import datetime
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from itertools import permutations, product
from types import MappingProxyType
from typing import Any

from kpr.model import (
    NO_HINTS,
    V6,
    Endpoint,
    EndpointPort,
    Endpoints,
    EndpointSlice,
    Hints,
    IPAddress,
    IPNetwork,
    ObjectRef,
    Service,
    ServicePort,
    conditions_of,
)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # an EndpointSlice's Service
SERVICE_PROXY_NAME_LABEL = "service.kubernetes.io/service-proxy-name"  # a Service's proxy
# the labels kpr reads: an object keeps these only (every label is still validated)
KEPT_LABELS = frozenset((SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL))
NO_LABELS: Mapping[str, str] = MappingProxyType({})  # (one object for every unlabelled one)
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"  # the cluster autoscaler's
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
SERVICE_PROTOCOLS = ("TCP", "UDP", "SCTP")
ADDRESS_TYPES = ("IPv4", "IPv6", "FQDN")
TRAFFIC_POLICIES = ("Cluster", "Local")
SESSION_AFFINITIES = ("None", "ClientIP")
DEFAULT_AFFINITY_TIMEOUT = 10800
MAX_AFFINITY_TIMEOUT = 86400  # the API server's limit


class ObjectError(ValueError):
    """A Kubernetes object kpr cannot use, with the field that is wrong."""

    def __init__(self, ref: ObjectRef | None, field: str, message: str) -> None:
        self.ref = ref
        self.field = field
        self.message = message
        super().__init__(str(self))

    def __str__(self) -> str:
        what = f"{self.field}: {self.message}"
        return f"{self.ref}: {what}" if self.ref else what


# --- typed field readers: each names the field path in its error -------------------


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _mapping(value: object, ref: ObjectRef | None, path: str) -> dict[str, Any]:
    """A nested object; null or missing is an empty one, as in the API."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ObjectError(ref, path, f"must be a mapping, not {_type_name(value)}")
    return value


def _list(value: object, ref: ObjectRef, path: str) -> list[Any]:
    """A list field; null or missing is an empty list, as in the API."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ObjectError(ref, path, f"must be a list, not {_type_name(value)}")
    return value


def _string(value: object, ref: ObjectRef | None, path: str, default: str = "") -> str:
    if value is None:
        return default
    if not isinstance(value, str):
        raise ObjectError(ref, path, f"must be a string, not {_type_name(value)}")
    return value


def _choice(
    value: object, ref: ObjectRef, path: str, choices: tuple[str, ...], default: str | None
) -> str:
    if value is None and default is not None:
        return default
    if value not in choices:
        raise ObjectError(ref, path, f"{value!r} is not one of {', '.join(choices)}")
    return choices[choices.index(value)]  # the constant, not the parser's copy


def _bool(value: object, ref: ObjectRef, path: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ObjectError(ref, path, f"must be true or false, not {value!r}")
    return value


def _int(value: object, ref: ObjectRef, path: str) -> int:
    # bool is an int in Python; `port: true` is still wrong.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ObjectError(ref, path, f"must be an integer, not {value!r}")
    return value


def _port(value: object, ref: ObjectRef, path: str) -> int:
    port = _int(value, ref, path)
    if not 1 <= port <= 65535:
        raise ObjectError(ref, path, f"{port} is not a valid port (1-65535)")
    return port


_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}
_FROM_PACKED = ((socket.AF_INET, IPv4Address), (socket.AF_INET6, IPv6Address))


def packed_ip(value: str) -> IPAddress | None:
    """The address `value` names, parsed by the C library (4x faster than the ipaddress
    module, which `_ip` keeps for its errors); None: not an address."""
    for family, make in _FROM_PACKED:
        try:
            return make(socket.inet_pton(family, value))
        except OSError:
            continue
    return None


def _ip(value: object, ref: ObjectRef, path: str, version: int | None = None) -> IPAddress:
    if not isinstance(value, str):
        raise ObjectError(ref, path, f"must be an IP address string, not {value!r}")
    address = packed_ip(value)
    if address is not None and (version is None or address.version == version):
        return address
    try:
        # A zone ("%eth0") is accepted by Python but never valid in Kubernetes.
        if "%" in value:
            raise ValueError(value)
        address = ip_address(value)
    except ValueError:
        raise ObjectError(ref, path, f"{value!r} is not a valid IP address") from None
    if version is not None and address.version != version:
        raise ObjectError(ref, path, f"{value!r} is not an IPv{version} address")
    return address


def _address_value(value: object, ref: ObjectRef, path: str, version: int) -> int:
    """An endpoint's address as an `address_value`, parsed by the C library: the ipaddress
    module takes some microseconds an address, seconds for a large cluster's million."""
    try:
        packed = socket.inet_pton(_FAMILIES[version], value)  # type: ignore[arg-type]
    except (OSError, TypeError):
        _ip(value, ref, path, version)  # its error, if it has one: not an IP, the other family
        raise ObjectError(ref, path, f"{value!r} is not a valid IP address") from None
    return int.from_bytes(packed, "big") | (V6 if version == 6 else 0)


def _metadata(obj: dict[str, Any], kind: str) -> tuple[ObjectRef, Mapping[str, str]]:
    metadata = _mapping(obj.get("metadata"), None, "metadata")
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise ObjectError(None, "metadata.name", f"a {kind} must have a name")
    # (one string object per namespace, not one per object)
    namespace = sys.intern(
        _string(metadata.get("namespace"), None, "metadata.namespace") or "default"
    )
    ref = ObjectRef(kind, namespace, name)
    labels = _mapping(metadata.get("labels"), ref, "metadata.labels")
    for key, value in labels.items():
        _string(value, ref, f"metadata.labels[{key}]")  # each one validated
    return ref, kept_labels(labels)


def kept_labels(labels: Mapping[str, str]) -> Mapping[str, str]:
    """The labels kpr reads (KEPT_LABELS) of valid `labels`: one shared empty mapping
    for the many objects without them."""
    return {k: labels[k] for k in KEPT_LABELS if k in labels} or NO_LABELS


# --- Service -------------------------------------------------------------------------


def parse_service(obj: dict[str, Any]) -> Service:
    """Validate a v1 Service."""
    ref, labels = _metadata(obj, "Service")
    spec = _mapping(obj.get("spec"), ref, "spec")
    ports = tuple(
        _service_port(port, ref, f"spec.ports[{i}]")
        for i, port in enumerate(_list(spec.get("ports"), ref, "spec.ports"))
    )
    _check_unique_ports(ports, ref)
    external_ips = tuple(
        _ip(value, ref, f"spec.externalIPs[{i}]")
        for i, value in enumerate(_list(spec.get("externalIPs"), ref, "spec.externalIPs"))
    )
    health_check_node_port = spec.get("healthCheckNodePort")
    return Service(
        namespace=ref.namespace,
        name=ref.name,
        type=_choice(spec.get("type"), ref, "spec.type", SERVICE_TYPES, "ClusterIP"),
        cluster_ips=_cluster_ips(spec, ref),
        ports=ports,
        labels=labels,
        external_ips=external_ips,
        session_affinity=_choice(
            spec.get("sessionAffinity"), ref, "spec.sessionAffinity", SESSION_AFFINITIES, "None"
        ),
        affinity_timeout=_affinity_timeout(spec, ref),
        internal_traffic_policy=_choice(
            spec.get("internalTrafficPolicy"),
            ref,
            "spec.internalTrafficPolicy",
            TRAFFIC_POLICIES,
            "Cluster",
        ),
        external_traffic_policy=_choice(
            spec.get("externalTrafficPolicy"),
            ref,
            "spec.externalTrafficPolicy",
            TRAFFIC_POLICIES,
            "Cluster",
        ),
        load_balancer_ips=_load_balancer_ips(obj, ref),
        load_balancer_source_ranges=tuple(
            _cidr(value, ref, f"spec.loadBalancerSourceRanges[{i}]")
            for i, value in enumerate(
                _list(spec.get("loadBalancerSourceRanges"), ref, "spec.loadBalancerSourceRanges")
            )
        ),
        health_check_node_port=None
        if health_check_node_port is None
        else _port(health_check_node_port, ref, "spec.healthCheckNodePort"),
    )


def _load_balancer_ips(obj: dict[str, Any], ref: ObjectRef) -> tuple[IPAddress, ...]:
    """status.loadBalancer.ingress[].ip, but not those with ipMode Proxy: their load
    balancer proxies the traffic and sends it to the node, not to the IP."""
    status = _mapping(obj.get("status"), ref, "status")
    load_balancer = _mapping(status.get("loadBalancer"), ref, "status.loadBalancer")
    ips = []
    path = "status.loadBalancer.ingress"
    for i, value in enumerate(_list(load_balancer.get("ingress"), ref, path)):
        ingress = _mapping(value, ref, f"{path}[{i}]")
        mode = _choice(ingress.get("ipMode"), ref, f"{path}[{i}].ipMode", ("VIP", "Proxy"), "VIP")
        if ingress.get("ip") is not None and mode == "VIP":
            ips.append(_ip(ingress["ip"], ref, f"{path}[{i}].ip"))
    return tuple(ips)


def _cidr(value: object, ref: ObjectRef, path: str) -> IPNetwork:
    if not isinstance(value, str):
        raise ObjectError(ref, path, f"must be a CIDR string, not {value!r}")
    try:
        # kube-proxy trims spaces; host bits set are tolerated as the API server does
        return ip_network(value.strip(), strict=False)
    except ValueError:
        raise ObjectError(ref, path, f"{value!r} is not a valid CIDR") from None


def _cluster_ips(spec: dict[str, Any], ref: ObjectRef) -> tuple[IPAddress, ...]:
    """spec.clusterIPs (dual-stack), else spec.clusterIP; empty when headless."""
    cluster_ip = _string(spec.get("clusterIP"), ref, "spec.clusterIP")
    values = [
        _string(value, ref, f"spec.clusterIPs[{i}]")
        for i, value in enumerate(_list(spec.get("clusterIPs"), ref, "spec.clusterIPs"))
    ]
    if values:
        # The API server keeps the two equal; a hand edit of one of them is a mistake.
        if cluster_ip and cluster_ip != values[0]:
            raise ObjectError(
                ref, "spec.clusterIP", f"{cluster_ip!r} differs from spec.clusterIPs[0]"
            )
        paths = [f"spec.clusterIPs[{i}]" for i in range(len(values))]
    else:
        values = [cluster_ip] if cluster_ip else []
        paths = ["spec.clusterIP"]
    if not values or values[0] in ("None", ""):
        return ()
    if len(values) > 2:
        raise ObjectError(ref, "spec.clusterIPs", "at most one IPv4 and one IPv6 address")
    addresses = tuple(_ip(value, ref, path) for value, path in zip(values, paths, strict=True))
    if len(addresses) == 2 and addresses[0].version == addresses[1].version:
        raise ObjectError(ref, paths[1], "must be of the other IP family than spec.clusterIPs[0]")
    return addresses


def _service_port(value: object, ref: ObjectRef, path: str) -> ServicePort:
    port = _mapping(value, ref, path)
    node_port = port.get("nodePort")
    return ServicePort(
        name=_name(port.get("name"), ref, f"{path}.name") or "",
        protocol=_choice(port.get("protocol"), ref, f"{path}.protocol", SERVICE_PROTOCOLS, "TCP"),
        port=_port(port.get("port"), ref, f"{path}.port"),
        node_port=None if node_port is None else _port(node_port, ref, f"{path}.nodePort"),
    )


def _check_unique_ports(ports: tuple[ServicePort, ...], ref: ObjectRef) -> None:
    # Endpoint ports are matched by name, and frontends by port/protocol: both must be unique.
    names: dict[str, int] = {}
    numbers: dict[tuple[int, str], int] = {}
    for i, port in enumerate(ports):
        if port.name in names:
            raise ObjectError(
                ref,
                f"spec.ports[{i}].name",
                f"{port.name!r} is also the name of spec.ports[{names[port.name]}]"
                " (the ports of a multi-port Service need unique names)",
            )
        if (port.port, port.protocol) in numbers:
            raise ObjectError(
                ref,
                f"spec.ports[{i}].port",
                f"{port.port}/{port.protocol} is also "
                f"spec.ports[{numbers[port.port, port.protocol]}]",
            )
        names[port.name] = i
        numbers[port.port, port.protocol] = i


def _affinity_timeout(spec: dict[str, Any], ref: ObjectRef) -> int:
    path = "spec.sessionAffinityConfig"
    config = _mapping(spec.get("sessionAffinityConfig"), ref, path)
    client_ip = _mapping(config.get("clientIP"), ref, f"{path}.clientIP")
    value = client_ip.get("timeoutSeconds")
    if value is None:
        return DEFAULT_AFFINITY_TIMEOUT
    timeout = _int(value, ref, f"{path}.clientIP.timeoutSeconds")
    if not 1 <= timeout <= MAX_AFFINITY_TIMEOUT:
        raise ObjectError(
            ref,
            f"{path}.clientIP.timeoutSeconds",
            f"{timeout} is not between 1 and {MAX_AFFINITY_TIMEOUT}",
        )
    return timeout


# --- EndpointSlice ---------------------------------------------------------------------


def parse_endpoint_slice(obj: dict[str, Any]) -> EndpointSlice:
    """Validate a discovery.k8s.io/v1 EndpointSlice."""
    ref, labels = _metadata(obj, "EndpointSlice")
    address_type = _choice(obj.get("addressType"), ref, "addressType", ADDRESS_TYPES, None)
    ports = tuple(
        _endpoint_port(port, ref, f"ports[{i}]")
        for i, port in enumerate(_list(obj.get("ports"), ref, "ports"))
    )
    endpoints = _list(obj.get("endpoints"), ref, "endpoints")
    return EndpointSlice(
        namespace=ref.namespace,
        name=ref.name,
        service_name=labels.get(SERVICE_NAME_LABEL),
        address_type=address_type,
        ports=ports,
        # FQDN addresses are host names, not IPs, and kube-proxy ignores those slices.
        endpoints=Endpoints()
        if address_type == "FQDN"
        else _endpoints(endpoints, ref, 4 if address_type == "IPv4" else 6),
        trigger_time=_trigger_time(obj),
    )


TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


def _trigger_time(obj: dict[str, Any]) -> float | None:
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    if not isinstance(annotations, dict):
        return None
    return trigger_time(annotations.get(TRIGGER_TIME_ANNOTATION))


def trigger_time(value: object) -> float | None:
    """When the change a slice carries happened (for network programming latency), from
    its annotation; an unreadable value only loses the measurement, never the slice."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _endpoint_port(value: object, ref: ObjectRef, path: str) -> EndpointPort:
    port = _mapping(value, ref, path)
    number = port.get("port")
    return EndpointPort(
        name=_name(port.get("name"), ref, f"{path}.name") or "",
        protocol=_choice(port.get("protocol"), ref, f"{path}.protocol", SERVICE_PROTOCOLS, "TCP"),
        port=None if number is None else _port(number, ref, f"{path}.port"),
    )


def _endpoints(values: list[Any], ref: ObjectRef, version: int) -> Endpoints:
    """A slice's endpoints, packed as they are read: no object an endpoint (a large
    cluster lists a million). The common shape is read by `_plain_endpoint`; any other,
    and any error, by `_endpoint`, which names the field."""
    family, width = _FAMILIES[version], 4 if version == 4 else 17
    prefix = b"" if version == 4 else b"\x01"  # (address_value's family bit)
    ips, conditions = bytearray(), bytearray()
    places: list[tuple[str | None, str | None]] = []
    hinted: dict[int, Hints] = {}  # (rare) the endpoints with hints, by index
    for i, value in enumerate(values):
        plain = _plain_endpoint(value, family)
        if plain is not None:
            ips += prefix + plain[0]
            conditions.append(plain[1])
            places.append(plain[2])
            continue
        endpoint = _endpoint(value, ref, f"endpoints[{i}]", version)
        ips += endpoint.ip.to_bytes(width, "big")
        conditions.append(conditions_of(endpoint.ready, endpoint.serving, endpoint.terminating))
        places.append((endpoint.node_name, endpoint.zone))
        hinted[i] = (endpoint.hints_for_nodes, endpoint.hints_for_zones)
    hints = [hinted.get(i, NO_HINTS) for i in range(len(places))] if hinted else []
    return Endpoints.packed(bytes(ips), width, bytes(conditions), places, hints)


# an endpoint's conditions as the API sends them (each true, false or null, in any
# order), and what `conditions_of` makes of them, looked up at once
_PLAIN_CONDITIONS = {
    tuple(zip(names, values, strict=True)): conditions_of(
        dict(zip(names, values, strict=True)).get("ready") is not False,
        dict(zip(names, values, strict=True)).get("serving") is not False,
        dict(zip(names, values, strict=True)).get("terminating") is True,
    )
    for n in range(4)
    for names in permutations(("ready", "serving", "terminating"), n)
    for values in product((True, False, None), repeat=n)
}
_READY_AND_SERVING = _PLAIN_CONDITIONS[()]


def _plain_endpoint(
    value: object, family: int
) -> tuple[bytes, int, tuple[str | None, str | None]] | None:
    """An endpoint of the common shape (one address, conditions true or false or unset,
    nodeName and zone, no hints), quickly: (its address packed, its `conditions_of`,
    (nodeName, zone)). None: any other shape, or an error, for `_endpoint` to read."""
    if type(value) is not dict or "hints" in value:
        return None
    addresses = value.get("addresses")
    if type(addresses) is not list or len(addresses) != 1:
        return None
    try:
        packed = socket.inet_pton(family, addresses[0])
    except (OSError, TypeError):
        return None
    given = value.get("conditions")
    conditions = _READY_AND_SERVING
    if given is not None:
        if type(given) is not dict:
            return None
        for condition in given.values():  # (1 == True: a number is not a condition)
            if condition is not True and condition is not False and condition is not None:
                return None
        known = _PLAIN_CONDITIONS.get(tuple(given.items()))
        if known is None:
            return None
        conditions = known
    node, zone = value.get("nodeName"), value.get("zone")
    if node is not None:
        if type(node) is not str:
            return None
        node = sys.intern(node)
    if zone is not None:
        if type(zone) is not str:
            return None
        zone = sys.intern(zone)
    return packed, conditions, (node, zone)


def _endpoint(value: object, ref: ObjectRef, path: str, version: int) -> Endpoint:
    endpoint = _mapping(value, ref, path)
    addresses = _list(endpoint.get("addresses"), ref, f"{path}.addresses")
    if not addresses:
        raise ObjectError(ref, f"{path}.addresses", "an endpoint needs at least one address")
    conditions = _mapping(endpoint.get("conditions"), ref, f"{path}.conditions")
    hints = _mapping(endpoint.get("hints"), ref, f"{path}.hints")
    for i, address in enumerate(addresses[1:], start=1):  # checked, not kept (`Endpoint`)
        _address_value(address, ref, f"{path}.addresses[{i}]", version)
    return Endpoint(
        ip=_address_value(addresses[0], ref, f"{path}.addresses[0]", version),
        ready=_bool(conditions.get("ready"), ref, f"{path}.conditions.ready", True),
        serving=_bool(conditions.get("serving"), ref, f"{path}.conditions.serving", True),
        terminating=_bool(
            conditions.get("terminating"), ref, f"{path}.conditions.terminating", False
        ),
        node_name=_name(endpoint.get("nodeName"), ref, f"{path}.nodeName"),
        zone=_name(endpoint.get("zone"), ref, f"{path}.zone"),
        hints_for_nodes=_hint_names(hints.get("forNodes"), ref, f"{path}.hints.forNodes"),
        hints_for_zones=_hint_names(hints.get("forZones"), ref, f"{path}.hints.forZones"),
    )


def _hint_names(value: object, ref: ObjectRef, path: str) -> tuple[str, ...] | None:
    """The names in hints.forNodes / hints.forZones; None when the hint is absent."""
    if value is None:
        return None
    names = []
    for i, hint in enumerate(_list(value, ref, path)):
        name = _mapping(hint, ref, f"{path}[{i}]").get("name")
        if not isinstance(name, str) or not name:
            raise ObjectError(ref, f"{path}[{i}].name", "must be a non-empty string")
        names.append(sys.intern(name))
    return tuple(names)


def _name(value: object, ref: ObjectRef, path: str) -> str | None:
    """A name that recurs (a node's, a zone's, a port's): one string object for all the
    objects that name it. (Not the names of objects: each is its own.)"""
    return None if value is None else sys.intern(_string(value, ref, path))


# --- dispatch ----------------------------------------------------------------------------

_PARSERS: dict[tuple[str, str], Callable[[dict[str, Any]], Service | EndpointSlice]] = {
    ("v1", "Service"): parse_service,
    ("discovery.k8s.io/v1", "EndpointSlice"): parse_endpoint_slice,
}


def parse_object(obj: dict[str, Any]) -> Service | EndpointSlice | None:
    """Validate a Service or EndpointSlice; None for any other apiVersion/kind."""
    parser = _PARSERS.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
    return parser(obj) if parser else None


def node_is_deleting(node: dict[str, Any]) -> bool:
    """Whether an API-shaped Node is going away, by upstream SyncNode's rule."""
    if (node.get("metadata") or {}).get("deletionTimestamp"):
        return True
    taints = (node.get("spec") or {}).get("taints") or []
    return any(isinstance(t, dict) and t.get("key") == TO_BE_DELETED_TAINT for t in taints)
