"""Why each endpoint of one Service does or does not get traffic on this node.

`kpr status NAMESPACE/NAME` asks this of the Service's objects as they are now. It is
pure and uses translate.py's own rules (merge_endpoints, categorize_endpoints,
topology_mode), so what it says is what translation does.
"""

from __future__ import annotations

from typing import Any

from kpr.desired.translate import (
    SERVICE_PROXY_NAME_LABEL,
    available_for_topology,
    categorize_endpoints,
    frontends_of,
    is_local,
    is_served,
    merge_endpoints,
    topology_mode,
)
from kpr.model import (
    EXTERNAL,
    PROTOCOLS,
    Backend,
    Endpoint,
    EndpointSlice,
    Frontend,
    NodeContext,
    Service,
    ServicePort,
)

FAMILIES = {"IPv4": 4, "IPv6": 6}


def explain(service: Service, slices: list[EndpointSlice], node: NodeContext) -> dict[str, Any]:
    """Frontends per port, and every endpoint with its conditions, node, zone and, for
    each traffic policy its frontends use, None (it gets traffic) or why it does not."""
    out: dict[str, Any] = {
        "service": f"{service.namespace}/{service.name}",
        "type": service.type,
        "internal_traffic_policy": service.internal_traffic_policy,
        "external_traffic_policy": service.external_traffic_policy,
        "not_served": _not_served(service, node),
        "ports": [],
    }
    if out["not_served"]:
        return out
    families: set[int] = {address.version for address in service.cluster_ips}
    for port in service.ports:
        entry: dict[str, Any] = {
            "name": port.name,
            "port": port.port,
            "protocol": port.protocol,
            "frontends": [],
            "endpoints": [],
        }
        out["ports"].append(entry)
        if port.protocol not in PROTOCOLS:
            entry["not_served"] = "kpr handles TCP and UDP only"
            continue
        policies: set[tuple[int, str]] = set()
        for frontend, kind, policy in frontends_of(service, port, node):
            shown = {"frontend": str(frontend), "kind": kind, "policy": policy}
            family = [s for s in slices if FAMILIES.get(s.address_type) == frontend.family]
            merged = merge_endpoints(port, family)
            if not categorize_endpoints(merged, policy, node):
                shown["no_endpoint"] = _no_endpoint(frontend, policy, merged)
            entry["frontends"].append(shown)
            policies.add((frontend.address.version, policy))
        for endpoint_slice in slices:
            version = FAMILIES.get(endpoint_slice.address_type)
            entry["endpoints"] += _slice_endpoints(
                port, endpoint_slice, slices, version, families, policies, node
            )
    return out


def _no_endpoint(frontend: Frontend, policy: str, merged: dict[Backend, Endpoint]) -> str:
    """What a client of a frontend without endpoints on this node gets, and why."""
    if not any(e.ready or (e.serving and e.terminating) for e in merged.values()):
        return "none: refused (no endpoint is ready or serving), as kube-proxy rejects"
    if frontend.scope == EXTERNAL:
        return "none here: dropped (externalTrafficPolicy Local), as kube-proxy drops"
    return (
        f"none here: refused at once ({policy} policy); kube-proxy drops these connections, "
        "a socket hook can only fail the call (README: drop versus refuse)"
    )


def _not_served(service: Service, node: NodeContext) -> str | None:
    if is_served(service, node):
        return None
    if service.type == "ExternalName":
        return "an ExternalName Service is DNS only: no proxy serves it"
    if not service.cluster_ips:
        return "a headless Service (no clusterIP) is DNS only: no proxy serves it"
    other = service.labels.get(SERVICE_PROXY_NAME_LABEL)
    return f"labelled {SERVICE_PROXY_NAME_LABEL}={other}: that proxy serves it, not this one"


def _slice_endpoints(
    port: ServicePort,
    endpoint_slice: EndpointSlice,
    slices: list[EndpointSlice],
    version: int | None,
    families: set[int],
    policies: set[tuple[int, str]],
    node: NodeContext,
) -> list[dict[str, Any]]:
    """The slice's endpoints for one Service port, each with why it gets no traffic."""
    matching = [
        p for p in endpoint_slice.ports if p.name == port.name and p.protocol == port.protocol
    ]
    slice_reason = None
    if version is None:
        slice_reason = f"addressType {endpoint_slice.address_type}: not proxied"
    elif version not in families:
        slice_reason = f"the Service has no IPv{version} clusterIP"
    elif not matching:
        slice_reason = (
            f"the slice has no port named {port.name!r} with protocol {port.protocol}"
            if port.name
            else f"the slice has no unnamed {port.protocol} port"
        )
    elif not any(p.port for p in matching):
        slice_reason = "invalid field: the slice's port has no number (unset or 0)"
    family_slices = [s for s in slices if FAMILIES.get(s.address_type) == version]
    origins: dict[Backend, tuple[str, int]] = {}
    merged = merge_endpoints(port, family_slices, origins) if slice_reason is None else {}
    number = next((p.port for p in matching if p.port), None)
    chosen = {
        policy: categorize_endpoints(merged, policy, node)
        for v, policy in sorted(policies)
        if v == version
    }
    out = []
    for index, endpoint in enumerate(endpoint_slice.endpoints):
        backend = Backend.at(endpoint.ip, number) if number else None
        entry: dict[str, Any] = {
            "address": str(backend) if backend else str(endpoint.address),
            "slice": endpoint_slice.name,
            "ready": endpoint.ready,
            "serving": endpoint.serving,
            "terminating": endpoint.terminating,
            "node": endpoint.node_name,
            "zone": endpoint.zone,
            "traffic": {},
        }
        if slice_reason is not None:
            entry["no_traffic"] = slice_reason
        elif origins.get(backend) != (endpoint_slice.name, index):  # type: ignore[arg-type]
            entry["no_traffic"] = "the same address and port in another slice is used instead"
        else:
            for policy, backends in chosen.items():
                entry["traffic"][policy] = _why_not(
                    endpoint, backend, backends, merged, policy, node
                )
        out.append(entry)
    return out


def _why_not(
    endpoint: Endpoint,
    backend: Backend | None,
    chosen: list[Backend],
    merged: dict[Backend, Endpoint],
    policy: str,
    node: NodeContext,
) -> str | None:
    """None when the endpoint gets traffic under `policy`, else the reason, in the order
    translation decides: node (Local), conditions, topology hints."""
    if backend in chosen:
        return None
    if policy == "Local" and not is_local(endpoint, node):
        where = f"node {endpoint.node_name}" if endpoint.node_name else "no node"
        return f"on {where}, not this node ({node.name}), and the traffic policy is Local"
    scope = list(merged.values())
    if policy == "Local":
        scope = [e for e in scope if is_local(e, node)]
    any_ready = any(e.ready for e in scope)
    if not endpoint.ready:
        if endpoint.serving and endpoint.terminating and any_ready:
            return "terminating: used only while no endpoint is ready"
        if endpoint.terminating:
            return "terminating and not serving"
        return "not ready"
    mode = topology_mode(merged.values(), node)
    if mode is not None and not available_for_topology(endpoint, mode, node):
        if mode == "Node":
            hints = ", ".join(endpoint.hints_for_nodes or ()) or "none"
            return f"outside this node's hints: hinted for node(s) {hints}, not {node.name}"
        hints = ", ".join(endpoint.hints_for_zones or ()) or "none"
        return f"outside this node's hints: hinted for zone(s) {hints}, not {node.zone}"
    return "not chosen"  # (no rule above explains it: a bug worth reporting)


def render(explained: dict[str, Any], programmed: dict[str, list[str]]) -> str:
    """For a terminal: `programmed` is what the maps hold per frontend (status's view)."""
    lines = [
        f"Service {explained['service']} ({explained['type']}; internalTrafficPolicy "
        f"{explained['internal_traffic_policy']}, externalTrafficPolicy "
        f"{explained['external_traffic_policy']})"
    ]
    if explained["not_served"]:
        lines.append(f"  not served: {explained['not_served']}")
        return "\n".join(lines)
    for port in explained["ports"]:
        name = f"{port['name']} " if port["name"] else ""
        lines.append(f"  port {name}{port['port']}/{port['protocol']}")
        if port.get("not_served"):
            lines.append(f"    not served: {port['not_served']}")
            continue
        for frontend in port["frontends"]:
            held = programmed.get(frontend["frontend"])
            backends = (
                "not in the maps"
                if held is None
                else ", ".join(held) or frontend.get("no_endpoint", "none (refused)")
            )
            lines.append(
                f"    {frontend['frontend']:<34} {frontend['kind']:<12} "
                f"{frontend['policy']:<7} -> {backends}"
            )
        lines.append("    endpoints:" if port["endpoints"] else "    endpoints: none")
        for e in port["endpoints"]:
            conditions = (
                ",".join(c for c in ("ready", "serving", "terminating") if e[c]) or "not ready"
            )
            where = f"{e['node'] or '-'}/{e['zone'] or '-'}"
            if "no_traffic" in e:
                verdict = f"no traffic: {e['no_traffic']}"
            else:
                verdict = (
                    "; ".join(
                        f"{policy}: " + ("gets traffic" if why is None else f"no traffic, {why}")
                        for policy, why in e["traffic"].items()
                    )
                    or "no frontend"
                )
            lines.append(f"      {e['address']:<24} {conditions:<26} {where:<20} {verdict}")
    return "\n".join(lines)
