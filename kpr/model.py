"""The vocabulary shared by the control plane and the datapath.

Kubernetes objects arrive as API-shaped dicts and are validated into the
frozen dataclasses below (kpr/sources/objects.py); translation (kpr/desired/translate.py)
turns them into the desired state: which frontends exist and which backends
serve each. The datapath (kpr/datapath/) makes the BPF maps equal to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

PROTOCOLS = ("TCP", "UDP")


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


@dataclass(frozen=True, slots=True)
class Endpoint:
    # addresses[0]: the one address kube-proxy uses (the API says consumers use only the
    # first); one object per endpoint is held by the 100,000, so the others are not kept
    address: IPAddress
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str | None = None
    zone: str | None = None
    hints_for_nodes: tuple[str, ...] | None = None
    hints_for_zones: tuple[str, ...] | None = None


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
    endpoints: tuple[Endpoint, ...] = ()
    trigger_time: float | None = None  # endpoints.kubernetes.io/last-change-trigger-time

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
def by_key(item: Frontend | Backend) -> tuple:
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

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        text = f"{host}:{self.port}/{self.protocol}"
        return f"{text} (external)" if self.scope == EXTERNAL else text


@dataclass(frozen=True, slots=True, eq=False, init=False)
class Backend:
    address: IPAddress
    port: int
    _hash: int = field(init=False, repr=False)

    def __init__(self, address: IPAddress, port: int) -> None:
        _set(self, "address", address)
        _set(self, "port", port)
        _set(self, "_hash", hash((int(address), port)))

    def sort_key(self) -> tuple:
        return (self.address.version, int(self.address), self.port)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Backend)
            and self._hash == other._hash
            and self.sort_key() == other.sort_key()
        )

    def __lt__(self, other: Backend) -> bool:
        return self.sort_key() < other.sort_key()

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class FrontendState:
    """What one frontend should do: which Service port it is, which backends serve."""

    service: str  # "namespace/name:portname", for status and errors
    backends: tuple[Backend, ...]  # sorted, unique; empty: refuse connections
    affinity_timeout: int = 0  # seconds; 0: no session affinity
    kind: str = "ClusterIP"  # ClusterIP | NodePort | LoadBalancer | ExternalIP, for status
    # loadBalancerSourceRanges (LoadBalancer IPs, external scope); empty: any source
    source_ranges: tuple[IPNetwork, ...] = ()
    # no backends only because of externalTrafficPolicy Local: drop, don't refuse
    drop: bool = False


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
