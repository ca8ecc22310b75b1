"""Services and EndpointSlices → the desired frontends and backends of the datapath.

Pure functions, one per policy decision, following kube-proxy's
endpointslicecache.go (which endpoints belong to a Service port) and
topology.go (which of them receive traffic on this node).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from ipaddress import IPv4Address

from kpr.model import (
    EXTERNAL,
    PROTOCOLS,
    SOCKET,
    Backend,
    Backends,
    Endpoint,
    EndpointSlice,
    Frontend,
    FrontendState,
    IPAddress,
    IPNetwork,
    NodeContext,
    Problem,
    Service,
    ServicePort,
    Translation,
)
from kpr.sources.objects import SERVICE_NAME_LABEL, SERVICE_PROXY_NAME_LABEL

LOCALHOST = IPv4Address("127.0.0.1")


def translate_service(
    service: Service, slices: Iterable[EndpointSlice], node: NodeContext
) -> Translation:
    """One Service's own frontends, from its slices (those labelled with its name).
    Whether another Service claims one of them too is for the desired state to decide
    (kpr/desired/state.py)."""
    translation = Translation()
    if is_served(service, node):
        # sorted by name; FQDN slices are not proxied
        ip_slices = sorted(
            (s for s in slices if s.address_type in ("IPv4", "IPv6")),
            key=lambda s: (s.namespace, s.name),
        )
        _translate_service(service, ip_slices, node, translation)
        key = (service.namespace, service.name)
        translation.owners = dict.fromkeys(translation.frontends, key)
    return translation


def _translate_service(
    service: Service,
    slices: list[EndpointSlice],
    node: NodeContext,
    translation: Translation,
) -> None:
    """Add the frontends of one Service: per port and protocol, each address it is
    reachable at (kube-proxy's "Addresses served"), for each kind of client."""
    affinity_timeout = service.affinity_timeout if service.session_affinity == "ClientIP" else 0
    if service.health_check_node_port and service.external_traffic_policy == "Local":
        translation.health_checks[(service.namespace, service.name)] = (
            service.health_check_node_port,
            local_ready_endpoints(service, slices, node),
        )
    # Each address is served from the slices of its own IP family.
    slices_of = {
        4: [s for s in slices if s.address_type == "IPv4"],
        6: [s for s in slices if s.address_type == "IPv6"],
    }
    no_local = no_local_endpoints(service, slices_of, node)
    if no_local != (0, 0):
        translation.no_local_endpoints[(service.namespace, service.name)] = no_local
    if service.type in ("NodePort", "LoadBalancer") or service.external_ips:
        local = frozenset(
            endpoint.address
            for endpoint_slice in slices
            for endpoint in endpoint_slice.endpoints
            if is_local(endpoint, node)
        )
        if local:
            translation.local_endpoints[(service.namespace, service.name)] = local
    for index, port in enumerate(service.ports):
        field = f"spec.ports[{index}]"
        if port.protocol not in PROTOCOLS:
            translation.problems.append(
                Problem(
                    f"{port.port}/{port.protocol} is not served: kpr handles TCP and UDP only",
                    ref=service.ref,
                    field=f"{field}.protocol",
                )
            )
            continue
        # a NodePort or LoadBalancer port has many frontends: the same backends for
        # each (family, traffic policy), selected once
        selected: dict[tuple[int, str], Backends] = {}
        for frontend, kind, policy in frontends_of(service, port, node):
            if kind == "ExternalIP" and not external_ip_allowed(frontend.address, node):
                if frontend.scope == SOCKET:  # one problem per address, not per scope
                    translation.problems.append(
                        Problem(
                            f"{frontend.address} is outside --external-ip-cidrs: not served",
                            service.ref,
                            f"spec.externalIPs[{service.external_ips.index(frontend.address)}]",
                        )
                    )
                continue
            version = frontend.address.version
            family_slices = slices_of[version]
            if (version, policy) not in selected:
                selected[(version, policy)] = select_backends(port, family_slices, policy, node)
            backends = selected[(version, policy)]  # as many as there are: no limit
            ranges: tuple[IPNetwork, ...] = ()
            if (
                kind == "LoadBalancer"
                and frontend.scope == SOCKET
                and not allowed_from_node(service, node)
            ):
                # the socket does not know the source yet: leave these connects to the
                # network, where the load balancer's TC entry checks them
                continue
            if kind == "LoadBalancer" and frontend.scope == EXTERNAL:
                # Only the LoadBalancer IPs, never the NodePort; each family its own ranges.
                ranges = tuple(
                    r
                    for r in service.load_balancer_source_ranges
                    if r.version == frontend.address.version
                )
                if service.load_balancer_source_ranges and not ranges:
                    continue  # no source of this family is allowed: nothing to serve
            # kube-proxy drops external traffic that has endpoints, just none on this node
            # (at the socket kpr cannot drop: it refuses, see README "Drop versus refuse")
            drop = (
                frontend.scope == EXTERNAL
                and policy == "Local"
                and not backends
                and has_endpoints(port, family_slices)
            )
            translation.frontends[frontend] = FrontendState(
                service_port_name(service, port), backends, affinity_timeout, kind, ranges, drop
            )


def port_field(service: Service, frontend: Frontend, node: NodeContext) -> str | None:
    """The Service port a frontend of the Service is served for, as a field path."""
    for index, port in enumerate(service.ports):
        if any(f == frontend for f, _, _ in frontends_of(service, port, node)):
            return f"spec.ports[{index}]"
    return None


def frontends_of(
    service: Service, port: ServicePort, node: NodeContext
) -> Iterator[tuple[Frontend, str, str]]:
    """(frontend, kind, traffic policy) for every address a Service port is served at.

    Processes and pods on the node (SOCKET scope) reach every endpoint by any
    address, as kube-proxy short-circuits them; traffic arriving from outside
    (EXTERNAL scope, the TC program) follows externalTrafficPolicy.
    """
    protocol = port.protocol
    for address in service.cluster_ips:
        yield Frontend(address, port.port, protocol), "ClusterIP", service.internal_traffic_policy
    if service.type == "ClusterIP" and not service.external_ips:
        return  # (most Services: nothing more to look at)
    node_port = port.node_port if service.type in ("NodePort", "LoadBalancer") else None
    external = [(address, port.port, "ExternalIP") for address in service.external_ips]
    if service.type == "LoadBalancer":
        external += [(address, port.port, "LoadBalancer") for address in service.load_balancer_ips]
    if node_port:
        external += [(address, node_port, "NodePort") for address in node.node_port_addresses]
    # kube-proxy runs one proxier per IP family, each serving the Services of its family
    families = {address.version for address in service.cluster_ips}
    for address, number, kind in external:
        if address.version not in families:
            continue
        yield Frontend(address, number, protocol, SOCKET), kind, "Cluster"
        if not address.is_loopback:
            policy = service.external_traffic_policy
            yield Frontend(address, number, protocol, EXTERNAL), kind, policy
    # IPv4 only, as kube-proxy's localhostNodePorts
    localhost = node.localhost_node_ports and 4 in families
    if node_port and localhost and LOCALHOST not in node.node_port_addresses:
        yield Frontend(LOCALHOST, node_port, protocol, SOCKET), "NodePort", "Cluster"


def no_local_endpoints(
    service: Service, slices_of: Mapping[int, list[EndpointSlice]], node: NodeContext
) -> tuple[int, int]:
    """(internal, external): the Service's ports, per IP family it serves, whose traffic
    policy is Local and that have endpoints, but none on this node — what kube-proxy's
    proxiers count for sync_proxy_rules_no_local_endpoints_total."""
    internal_local = service.internal_traffic_policy == "Local"
    external_local = service.external_traffic_policy == "Local" and (
        service.type in ("NodePort", "LoadBalancer") or bool(service.external_ips)
    )
    if not (internal_local or external_local):
        return 0, 0
    internal = external = 0
    for port in service.ports:
        for version in {address.version for address in service.cluster_ips}:
            endpoints = merge_endpoints(port, slices_of[version])
            if not cluster_endpoints(endpoints, node) or local_endpoints(endpoints, node):
                continue  # no endpoints anywhere, or some here
            internal += internal_local
            external += external_local
    return internal, external


def allowed_from_node(service: Service, node: NodeContext) -> bool:
    """loadBalancerSourceRanges let the node's own clients in only when a range holds a
    node address (kube-proxy's allowFromNode)."""
    ranges = service.load_balancer_source_ranges
    return not ranges or any(a in r for r in ranges for a in node.node_port_addresses)


def external_ip_allowed(address: IPAddress, node: NodeContext) -> bool:
    """Any user who may create Services can claim any externalIP and take its traffic
    (CVE-2020-8554); --external-ip-cidrs limits which ones kpr serves."""
    cidrs = node.external_ip_cidrs
    return cidrs is None or any(address in network for network in cidrs)


def has_endpoints(port: ServicePort, slices: list[EndpointSlice]) -> bool:
    """Whether a Local-policy port has endpoints anywhere (kube-proxy's hasAnyEndpoints in
    CategorizeEndpoints): ready ones, or serving and terminating ones."""
    return any(
        e.ready or (e.serving and e.terminating) for e in merge_endpoints(port, slices).values()
    )


def local_ready_endpoints(service: Service, slices: list[EndpointSlice], node: NodeContext) -> int:
    """What the healthCheckNodePort reports: ready endpoints on this node, counted per
    Service port as kube-proxy's LocalReadyEndpoints does."""
    return sum(
        1
        for port in service.ports
        for endpoint in merge_endpoints(port, slices).values()
        if endpoint.ready and is_local(endpoint, node)
    )


def select_backends(
    port: ServicePort, slices: Iterable[EndpointSlice], traffic_policy: str, node: NodeContext
) -> Backends:
    """The backends of one Service port on this node: sorted and unique (merged by ip:port)."""
    if traffic_policy == "Cluster":
        quick = _ready_backends(port, slices)
        if quick is not None:
            return quick
    endpoints = merge_endpoints(port, slices)
    # (a Backend is an int, sorted as Backend.sort_key sorts)
    return Backends(sorted(categorize_endpoints(endpoints, traffic_policy, node)))


def _ready_backends(port: ServicePort, slices: Iterable[EndpointSlice]) -> Backends | None:
    """`select_backends` under the Cluster policy in the common case, from the slices'
    packed columns (no Endpoint each: a large cluster has a million): the ready ones,
    when some are, none has topology hints and no ip:port is in two slices (which
    `merge_endpoints` resolves). None: not that case."""
    every: list[int] = []
    ready: list[int] = []
    for endpoint_slice in slices:
        for slice_port in endpoint_slice.ports:
            number = slice_port.port
            if slice_port.name != port.name or slice_port.protocol != port.protocol or not number:
                continue
            if endpoint_slice.endpoints.hinted:
                return None
            addresses, ready_addresses = endpoint_slice.endpoints.addresses()
            every += [address << 16 | number for address in addresses]
            ready += [address << 16 | number for address in ready_addresses]
    if not ready or len(set(every)) != len(every):
        return None  # none ready (terminating ones then), or an ip:port twice
    return Backends.of_values(sorted(set(ready)))


def is_served(service: Service, node: NodeContext) -> bool:
    """Whether this proxy programs the Service at all (kube-proxy's Service filter)."""
    if service.type == "ExternalName" or not service.cluster_ips:
        return False  # nothing to load-balance: DNS only, or headless
    # Unlabelled Services are the default proxy's; a labelled one belongs to the proxy it names.
    proxy_name = service.labels.get(SERVICE_PROXY_NAME_LABEL)
    return proxy_name is None or proxy_name == node.proxy_name


def orphan_slices(slices: Iterable[EndpointSlice]) -> list[Problem]:
    """Slices that name a Service which does not exist: a problem each."""
    return [
        Problem(
            f"names Service {s.namespace}/{s.service_name}, which does not exist",
            ref=s.ref,
            field=f"metadata.labels[{SERVICE_NAME_LABEL}]",
        )
        for s in sorted(slices, key=lambda s: (s.namespace, s.name))
    ]


def merge_endpoints(
    port: ServicePort,
    slices: Iterable[EndpointSlice],
    origins: dict[Backend, tuple[str, int]] | None = None,
) -> dict[Backend, Endpoint]:
    """The endpoints of one Service port across its slices, keyed by ip:port; in
    `origins`, if given, where each comes from (slice name, index in its endpoints).

    A slice port serves the Service port of the same name and protocol. When
    one ip:port is in two slices the non-terminating one wins, else the first.
    """
    merged: dict[Backend, Endpoint] = {}
    for endpoint_slice in slices:
        for slice_port in endpoint_slice.ports:
            if slice_port.name != port.name or slice_port.protocol != port.protocol:
                continue
            number = slice_port.port
            if not number:  # unset or 0: no port to send to
                continue
            for index, endpoint in enumerate(endpoint_slice.endpoints):
                backend = Backend.at(endpoint.ip, number)
                known = merged.get(backend)
                if known is None or (known.terminating and not endpoint.terminating):
                    merged[backend] = endpoint
                    if origins is not None:
                        origins[backend] = (endpoint_slice.name, index)
    return merged


def categorize_endpoints(
    endpoints: Mapping[Backend, Endpoint], traffic_policy: str, node: NodeContext
) -> list[Backend]:
    """The backends that receive traffic under the Service's traffic policy."""
    if traffic_policy == "Local":
        return local_endpoints(endpoints, node)
    return cluster_endpoints(endpoints, node)


def cluster_endpoints(endpoints: Mapping[Backend, Endpoint], node: NodeContext) -> list[Backend]:
    """Ready endpoints, narrowed by topology hints; none ready → serving+terminating ones."""
    ready = [backend for backend, endpoint in endpoints.items() if endpoint.ready]
    if not ready:
        # Graceful termination: topology is ignored, since no endpoint anywhere is ready.
        return [
            backend
            for backend, endpoint in endpoints.items()
            if endpoint.serving and endpoint.terminating
        ]
    mode = topology_mode(endpoints.values(), node)
    if mode is None:
        return ready
    # not empty: a mode is chosen only when a ready endpoint's hint names this node or zone
    return [b for b in ready if available_for_topology(endpoints[b], mode, node)]


def local_endpoints(endpoints: Mapping[Backend, Endpoint], node: NodeContext) -> list[Backend]:
    """Ready endpoints on this node; none → serving+terminating ones on this node."""
    local = [(b, e) for b, e in endpoints.items() if is_local(e, node)]
    ready = [backend for backend, endpoint in local if endpoint.ready]
    if ready:
        return ready
    return [b for b, e in local if e.serving and e.terminating]


def is_local(endpoint: Endpoint, node: NodeContext) -> bool:
    return node.name is not None and endpoint.node_name == node.name


def topology_mode(endpoints: Iterable[Endpoint], node: NodeContext) -> str | None:
    """Which topology hints to follow: "Node", "Zone" or None (topology.go canUseTopology).

    Hints are followed only when every ready endpoint carries them and at
    least one is for this node (or zone); otherwise traffic could be sent
    nowhere, or unevenly while the hints are being rolled out.
    """
    ready = [endpoint for endpoint in endpoints if endpoint.ready]
    if not ready or not (ready[0].hints_for_nodes or ready[0].hints_for_zones):
        return None  # (the common case: no hints, and every endpoint must have them)
    if _hints_apply([e.hints_for_nodes for e in ready], node.name):
        return "Node"
    if _hints_apply([e.hints_for_zones for e in ready], node.zone):
        return "Zone"
    return None


def _hints_apply(hints: list[tuple[str, ...] | None], target: str | None) -> bool:
    """Every endpoint has this kind of hint, and one of them names the target."""
    return (
        target is not None
        and all(hints)
        and any(target in endpoint_hints for endpoint_hints in hints if endpoint_hints)
    )


def available_for_topology(endpoint: Endpoint, mode: str | None, node: NodeContext) -> bool:
    if mode == "Node":
        return node.name in (endpoint.hints_for_nodes or ())
    if mode == "Zone":
        return node.zone in (endpoint.hints_for_zones or ())
    return True


def service_port_name(service: Service, port: ServicePort) -> str:
    """The Service port as kube-proxy names it: namespace/name:port, or namespace/name."""
    base = f"{service.namespace}/{service.name}"
    return f"{base}:{port.name}" if port.name else base
