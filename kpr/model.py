"""The vocabulary shared by the control plane and the datapath.

Kubernetes objects arrive as API-shaped dicts and are validated into the
frozen dataclasses below (kpr/sources/objects.py); translation (kpr/desired/translate.py)
turns them into the desired state: which frontends exist and which backends
serve each. The datapath (kpr/datapath/) makes the BPF maps equal to it.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from itertools import repeat
from typing import NamedTuple, overload

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

PROTOCOLS = ("TCP", "UDP")

V6 = 1 << 128  # in an address value (`address_value`): the address is IPv6


def address_value(address: IPAddress) -> int:
    """An address as one int that sorts IPv4 before IPv6, then numerically."""
    return int(address) | V6 if address.version == 6 else int(address)


def address_of(value: int) -> IPAddress:
    """The address of an `address_value`."""
    return IPv6Address(value ^ V6) if value & V6 else IPv4Address(value)


def big_endian_ints(packed: bytes, width: int) -> list[int]:
    """The unsigned integers packed back to back in `packed`, `width` bytes each."""
    return [int.from_bytes(packed[i : i + width], "big") for i in range(0, len(packed), width)]


@dataclass(frozen=True, order=True, slots=True)
class ObjectRef:
    """Which object something is about, for error messages and status."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


# --- Kubernetes objects, validated -------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServicePort:
    name: str  # "" when the Service has a single unnamed port
    protocol: str  # "TCP" | "UDP" | "SCTP"
    port: int
    node_port: int | None = None


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: str = "ClusterIP"  # ClusterIP | NodePort | LoadBalancer | ExternalName
    cluster_ips: tuple[IPAddress, ...] = ()  # empty: headless
    ports: tuple[ServicePort, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    external_ips: tuple[IPAddress, ...] = ()
    session_affinity: str = "None"  # None | ClientIP
    affinity_timeout: int = 10800
    internal_traffic_policy: str = "Cluster"
    external_traffic_policy: str = "Cluster"
    # status.loadBalancer.ingress[].ip, except those with ipMode Proxy
    load_balancer_ips: tuple[IPAddress, ...] = ()
    load_balancer_source_ranges: tuple[IPNetwork, ...] = ()
    health_check_node_port: int | None = None

    @property
    def ref(self) -> ObjectRef:
        return ObjectRef("Service", self.namespace, self.name)


class Endpoint(NamedTuple):
    """One endpoint of a slice. A slice keeps its endpoints packed (`Endpoints`) and
    makes these as they are read: a tuple is the quickest object to make."""

    # addresses[0], the one address kube-proxy uses (the API says consumers use only the
    # first), as an `address_value`
    ip: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str | None = None
    zone: str | None = None
    hints_for_nodes: tuple[str, ...] | None = None
    hints_for_zones: tuple[str, ...] | None = None

    @property
    def address(self) -> IPAddress:
        return address_of(self.ip)


_make_endpoint = partial(tuple.__new__, Endpoint)  # (from a tuple of its fields, in C)
_READY, _SERVING, _TERMINATING = 1, 2, 4  # an endpoint's conditions, as `Endpoints` packs them
_CONDITIONS = tuple(  # each packed value's three booleans
    (bool(c & _READY), bool(c & _SERVING), bool(c & _TERMINATING)) for c in range(8)
)
Hints = tuple[tuple[str, ...] | None, tuple[str, ...] | None]  # (forNodes, forZones)
_NOWHERE: tuple[None, None] = (None, None)  # an endpoint's (nodeName, zone), unset
NO_HINTS: Hints = (None, None)


def conditions_of(ready: bool, serving: bool, terminating: bool) -> int:
    """An endpoint's conditions, as `Endpoints` packs them (one byte)."""
    return ready * _READY | serving * _SERVING | terminating * _TERMINATING


class Endpoints(Sequence[Endpoint]):
    """A slice's endpoints, packed: 7-9 bytes each where objects took about 200 (a large
    cluster's agent holds a million). Equal to a sequence of the same Endpoints."""

    __slots__ = ("_ips", "_width", "_conditions", "_names", "_places", "_hints")

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        endpoints = tuple(endpoints)
        ips = [e.ip for e in endpoints]
        # 4 bytes an IPv4 address; 17 (address_value's family bit and 16) otherwise
        if max(ips, default=0) < 1 << 32:
            self._fill(struct.pack(f">{len(ips)}I", *ips), 4, endpoints)
        else:
            self._fill(b"".join(ip.to_bytes(17, "big") for ip in ips), 17, endpoints)

    def _fill(self, ips: bytes, width: int, endpoints: tuple[Endpoint, ...]) -> None:
        self._set(
            ips,
            width,
            bytes(conditions_of(e.ready, e.serving, e.terminating) for e in endpoints),
            [(e.node_name, e.zone) for e in endpoints],
            [(e.hints_for_nodes, e.hints_for_zones) for e in endpoints],
        )

    @classmethod
    def packed(
        cls,
        ips: bytes,
        width: int,
        conditions: bytes,
        places: Sequence[tuple[str | None, str | None]],
        hints: Sequence[Hints] = (),
    ) -> Endpoints:
        """From their columns: addresses packed `width` bytes each (an `address_value`,
        big-endian), each one's `conditions_of` byte, (nodeName, zone) and, when any has
        them, (hints.forNodes, hints.forZones)."""
        endpoints = cls.__new__(cls)
        endpoints._set(ips, width, conditions, places, hints)
        return endpoints

    def _set(
        self,
        ips: bytes,
        width: int,
        conditions: bytes,
        places: Sequence[tuple[str | None, str | None]],
        hints: Sequence[Hints],
    ) -> None:
        self._ips, self._width, self._conditions = ips, width, conditions
        # node and zone names: a table of the distinct ones, two indexes an endpoint
        names: dict[str | None, int] = {None: 0}
        self._places: array[int] | None = None
        if any(place != _NOWHERE for place in places):
            self._places = array(
                "H", [names.setdefault(name, len(names)) for place in places for name in place]
            )
        self._names = tuple(names)
        self._hints: tuple[Hints, ...] | None = None
        if any(hint != NO_HINTS for hint in hints):
            self._hints = tuple(hints)

    def __len__(self) -> int:
        return len(self._conditions)

    @property
    def hinted(self) -> bool:
        """Whether any endpoint has topology hints."""
        return self._hints is not None

    def addresses(self) -> tuple[list[int], list[int]]:
        """(every endpoint's address, the ready ones' addresses), as `address_value`s, read
        from the columns at once (no Endpoint each)."""
        n = len(self)
        if self._width == 4:
            ips: list[int] = list(struct.unpack(f">{n}I", self._ips))
        else:
            ips = big_endian_ints(self._ips, 17)
        return ips, [ip for ip, c in zip(ips, self._conditions, strict=True) if c & _READY]

    @overload
    def __getitem__(self, index: int) -> Endpoint: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Endpoint, ...]: ...

    def __getitem__(self, index: int | slice) -> Endpoint | tuple[Endpoint, ...]:
        everything = tuple(self)  # (a slice's endpoints are read whole, by iteration)
        return everything[index]

    def __iter__(self) -> Iterator[Endpoint]:
        """Each endpoint, made from columns decoded at once (a microsecond an endpoint
        less than one at a time: translation reads a million at start-up)."""
        n = len(self)
        if self._width == 4:
            ips: Iterable[int] = struct.unpack(f">{n}I", self._ips)
        else:
            ips = (int.from_bytes(self._ips[i : i + 17], "big") for i in range(0, 17 * n, 17))
        conditions = [_CONDITIONS[c] for c in self._conditions]
        nodes: Iterable[str | None] = repeat(None, n)
        zones: Iterable[str | None] = repeat(None, n)
        if self._places is not None:
            nodes = map(self._names.__getitem__, self._places[0::2])
            zones = map(self._names.__getitem__, self._places[1::2])
        for_nodes: Iterable[tuple[str, ...] | None] = repeat(None, n)
        for_zones: Iterable[tuple[str, ...] | None] = repeat(None, n)
        if self._hints is not None:
            for_nodes = (h[0] for h in self._hints)
            for_zones = (h[1] for h in self._hints)
        columns = zip(
            ips,
            (c[0] for c in conditions),
            (c[1] for c in conditions),
            (c[2] for c in conditions),
            nodes,
            zones,
            for_nodes,
            for_zones,
            strict=True,
        )
        return map(_make_endpoint, columns)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        places = None if self._places is None else self._places.tobytes()
        return hash((self._ips, self._conditions, self._names, places, self._hints))

    def __repr__(self) -> str:
        return f"Endpoints({list(self)!r})"


@dataclass(frozen=True, slots=True)
class EndpointPort:
    name: str  # "" when unnamed
    protocol: str
    port: int | None  # None: unset (the slice carries no port)


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    service_name: str | None  # label kubernetes.io/service-name; None: not owned
    address_type: str  # IPv4 | IPv6 | FQDN
    ports: tuple[EndpointPort, ...] = ()
    endpoints: Endpoints = Endpoints()  # (any sequence of Endpoint given is packed)
    trigger_time: float | None = None  # endpoints.kubernetes.io/last-change-trigger-time

    def __post_init__(self) -> None:
        if not isinstance(self.endpoints, Endpoints):
            object.__setattr__(self, "endpoints", Endpoints(self.endpoints))

    @property
    def ref(self) -> ObjectRef:
        return ObjectRef("EndpointSlice", self.namespace, self.name)


@dataclass(frozen=True)
class NodeContext:
    """What translation needs to know about the node kpr runs on."""

    name: str | None = None
    zone: str | None = None
    proxy_name: str = "kpr"  # Services labelled service-proxy-name=<this> are ours too
    # where NodePorts are served: the node's addresses narrowed by nodePortAddresses
    node_port_addresses: tuple[IPAddress, ...] = ()
    localhost_node_ports: bool = True  # also 127.0.0.1, for processes on the node
    # --external-ip-cidrs: externalIPs outside these are not served (CVE-2020-8554); None: all
    external_ip_cidrs: tuple[IPNetwork, ...] | None = None


# --- Desired datapath state ----------------------------------------------------------


# Frontends and backends are hashed and sorted by the hundred thousand: each
# keeps its hash (ipaddress hashes slowly), and sorts by `sort_key` (IPv4
# before IPv6, then numerically; the ipaddress classes refuse to compare
# across families).
def by_key(item: Frontend | Backend) -> tuple | int:
    return item.sort_key()


# Which clients a frontend serves; mirrors KPR_SCOPE_* in bpf/kpr.h.
SOCKET = 0  # processes and pods on this node, at the socket (cgroup hooks)
EXTERNAL = 1  # packets arriving on the node's devices (TC)


# Frontend and Backend write their own __init__: the generated one of a frozen
# dataclass (and __post_init__) costs twice as much, for 100,000s of objects.
_set = object.__setattr__


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Frontend:
    """One address:port/protocol the datapath answers for, for one kind of client."""

    address: IPAddress
    port: int
    protocol: str  # "TCP" | "UDP"
    scope: int = SOCKET
    _hash: int = field(init=False, repr=False)

    def __init__(self, address: IPAddress, port: int, protocol: str, scope: int = SOCKET) -> None:
        _set(self, "address", address)
        _set(self, "port", port)
        _set(self, "protocol", protocol)
        _set(self, "scope", scope)
        _set(self, "_hash", hash((int(address), port, protocol, scope)))

    def sort_key(self) -> tuple:
        return (self.address.version, int(self.address), self.port, self.protocol, self.scope)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Frontend)
            and self._hash == other._hash
            and self.sort_key() == other.sort_key()
        )

    def __lt__(self, other: Frontend) -> bool:
        return self.sort_key() < other.sort_key()

    @property
    def family(self) -> int:
        return self.address.version

    @property
    def packed_address(self) -> bytes:
        return self.address.packed

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        text = f"{host}:{self.port}/{self.protocol}"
        return f"{text} (external)" if self.scope == EXTERNAL else text


# every IPv6 Backend's value is at least this, every IPv4 one's below 2**48 (so it fits a
# 64-bit integer): the IPv6 backends sort after every IPv4 one
FIRST_V6_BACKEND = V6 << 16


class Backend(int):
    """A backend's address and port, packed in one int: (address_value << 16) | port.

    An int, as 100,000s are held (by every frontend they serve and by the programmed
    state's indexes): 32-44 bytes each where an object with an address object took 170,
    and hashing, equality and order (IPv4 before IPv6, then address, then port) are the
    int's own, in C. (An int, it also equals that int: nothing mixes the two.)"""

    __slots__ = ()

    def __new__(cls, address: IPAddress, port: int) -> Backend:
        return int.__new__(cls, address_value(address) << 16 | port)

    @classmethod
    def at(cls, value: int, port: int) -> Backend:
        """The backend at an `address_value` and port (no address object made)."""
        return int.__new__(cls, value << 16 | port)

    def __getnewargs__(self) -> tuple[IPAddress, int]:  # type: ignore[override]  # (pickle)
        return (self.address, self.port)

    @property
    def address(self) -> IPAddress:
        return address_of(self >> 16)

    @property
    def port(self) -> int:
        return self & 0xFFFF

    @property
    def family(self) -> int:
        return 6 if self >> 16 & V6 else 4

    @property
    def packed_address(self) -> bytes:
        """The address in network order (4 or 16 bytes), as the maps hold it."""
        value = self >> 16
        return (value ^ V6).to_bytes(16, "big") if value & V6 else value.to_bytes(4, "big")

    def sort_key(self) -> int:
        return int(self)

    @staticmethod
    def count_v6(backends: Iterable[Backend]) -> int:
        """How many of `backends` are IPv6 (compared in C: a million in some ms)."""
        return sum(map(FIRST_V6_BACKEND.__le__, backends))

    def __str__(self) -> str:
        value, port = self >> 16, self & 0xFFFF
        if value & V6:
            return f"[{IPv6Address(value ^ V6)}]:{port}"
        # (IPv4 by hand: the desired-state file writes a million at 100,000 Services)
        return f"{value >> 24}.{value >> 16 & 255}.{value >> 8 & 255}.{value & 255}:{port}"

    def __repr__(self) -> str:
        return f"Backend({self})"


# the Backend of a value, (address_value << 16) | port, made in C (no call to Backend's)
backend_of_value = partial(int.__new__, Backend)


_V6_WIDTH = 19  # bytes an IPv6 Backend's value takes (145 bits)


class Backends(Sequence[Backend]):
    """A frontend's backends, packed: 8 bytes each (19 for IPv6) where a tuple and its
    Backend objects took 56 (a large cluster's agent holds a million). Each Backend is
    made as it is read; `values` gives the plain ints. Equal to any sequence of the same
    Backends."""

    __slots__ = ("_packed", "_width")

    def __init__(self, backends: Iterable[Backend] = ()) -> None:
        self._set(list(backends))

    @classmethod
    def of_values(cls, values: list[int]) -> Backends:
        """From Backend values ((address_value << 16) | port), in their order."""
        backends = cls.__new__(cls)
        backends._set(values)
        return backends

    def _set(self, values: list[int]) -> None:
        if max(values, default=0) < FIRST_V6_BACKEND:
            self._packed, self._width = array("Q", values).tobytes(), 8
        else:
            self._packed = b"".join(v.to_bytes(_V6_WIDTH, "big") for v in values)
            self._width = _V6_WIDTH

    @property
    def packed(self) -> bytes:
        """The values as native 64-bit integers, when all are IPv4 (else b"" and
        `is_v4` is False): for a numpy array without a copy."""
        return self._packed if self._width == 8 else b""

    @property
    def is_v4(self) -> bool:
        return self._width == 8 or not self._packed

    def values(self) -> list[int]:
        """Each Backend's value, as a plain int."""
        if self._width == 8:
            return array("Q", self._packed).tolist()
        return big_endian_ints(self._packed, self._width)

    def __len__(self) -> int:
        return len(self._packed) // self._width

    def __iter__(self) -> Iterator[Backend]:
        return map(backend_of_value, self.values())

    @overload
    def __getitem__(self, index: int) -> Backend: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Backend, ...]: ...

    def __getitem__(self, index: int | slice) -> Backend | tuple[Backend, ...]:
        return tuple(self)[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Backends):
            return self._packed == other._packed and self._width == other._width
        if not isinstance(other, Sequence):
            return NotImplemented
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))  # (as the tuple it equals)

    def __repr__(self) -> str:
        return f"Backends({list(self)!r})"


@dataclass(frozen=True, slots=True)
class FrontendState:
    """What one frontend should do: which Service port it is, which backends serve."""

    service: str  # "namespace/name:portname", for status and errors
    # sorted, unique; empty: refuse connections. (Any sequence given is packed.)
    backends: Backends
    affinity_timeout: int = 0  # seconds; 0: no session affinity
    kind: str = "ClusterIP"  # ClusterIP | NodePort | LoadBalancer | ExternalIP, for status
    # loadBalancerSourceRanges (LoadBalancer IPs, external scope); empty: any source
    source_ranges: tuple[IPNetwork, ...] = ()
    # no backends only because of externalTrafficPolicy Local: drop, don't refuse
    drop: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.backends, Backends):
            object.__setattr__(self, "backends", Backends(self.backends))


@dataclass(frozen=True)
class Problem:
    """Bad input, reported with the object and field it is about."""

    message: str
    ref: ObjectRef | None = None
    field: str | None = None
    source: str | None = None  # a file, for the manifest source

    def __str__(self) -> str:
        parts = [p for p in (self.source, str(self.ref) if self.ref else None) if p]
        where = ": ".join(parts)
        what = f"{self.field}: {self.message}" if self.field else self.message
        return f"{where}: {what}" if where else what


ServiceName = tuple[str, str]  # (namespace, name) of a Service, as Kubernetes names it


@dataclass
class Snapshot:
    """What a source holds now. `changed` names the Services whose objects (the
    Service or its slices) changed since the last snapshot, and then `services`
    and `slices` hold only those; None: everything, the whole state."""

    services: list[Service]
    slices: list[EndpointSlice]
    problems: list[Problem]
    changed: set[ServiceName] | None = None
    zone: str | None = None  # this node's topology.kubernetes.io/zone
    node_deleting: bool = False
    node_addresses: tuple[IPAddress, ...] = ()  # this Node's InternalIPs (status.addresses)


@dataclass
class Translation:
    """The output of translation: the whole desired state of the datapath.

    `held` frontends could not be computed from the input (an error in their
    Service or slices); the datapath leaves whatever it has programmed for them.
    """

    frontends: dict[Frontend, FrontendState] = field(default_factory=dict)
    held: set[Frontend] = field(default_factory=set)
    problems: list[Problem] = field(default_factory=list)
    owners: dict[Frontend, ServiceName] = field(default_factory=dict)  # which Service has it
    # externalTrafficPolicy Local Services: (healthCheckNodePort, local ready endpoints)
    health_checks: dict[ServiceName, tuple[int, int]] = field(default_factory=dict)
    # Service ports (per IP family) with a Local traffic policy, endpoints, and none on
    # this node: (internal, external) counts, kube-proxy's no_local_endpoints_total
    no_local_endpoints: dict[ServiceName, tuple[int, int]] = field(default_factory=dict)
    # Services with external frontends: their endpoints' addresses on this node, whose
    # external flows keep the client address (the others' are masqueraded)
    local_endpoints: dict[ServiceName, frozenset[IPAddress]] = field(default_factory=dict)
