"""Services, endpoints and EndpointSlices of kpr.model with the defaults the translation
tests use (shared by the translate and explain tests)."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

from kpr.model import (
    Endpoint,
    EndpointPort,
    EndpointSlice,
    NodeContext,
    Service,
    ServicePort,
    address_value,
)

HTTP = ServicePort(name="http", protocol="TCP", port=80)


def service(
    name: str = "web",
    cluster_ips: tuple[str, ...] = ("10.96.0.10",),
    ports: tuple[ServicePort, ...] = (HTTP,),
    namespace: str = "default",
    **fields: Any,
) -> Service:
    return Service(
        namespace=namespace,
        name=name,
        cluster_ips=tuple(ip_address(ip) for ip in cluster_ips),
        ports=ports,
        **fields,
    )


def endpoint(address: str, **fields: Any) -> Endpoint:
    return Endpoint(ip=address_value(ip_address(address)), **fields)


def endpoint_slice(
    *endpoints: Endpoint,
    name: str = "web-abc12",
    service_name: str | None = "web",
    address_type: str = "IPv4",
    ports: tuple[EndpointPort, ...] = (EndpointPort("http", "TCP", 8080),),
    namespace: str = "default",
) -> EndpointSlice:
    return EndpointSlice(
        namespace=namespace,
        name=name,
        service_name=service_name,
        address_type=address_type,
        ports=ports,
        endpoints=endpoints,
    )


NODE_IP = ip_address("192.168.50.2")


EXTERNAL_NODE = NodeContext(name="node-1", node_port_addresses=(NODE_IP,))


HTTP_NP = ServicePort(name="http", protocol="TCP", port=80, node_port=30080)
