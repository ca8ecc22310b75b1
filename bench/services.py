"""The Services every mode is programmed with: N Services × M endpoints, a few of them ("real"
ones, spread evenly through the list so a linear rule scan meets them half way on average)
backed by the lab's pods, the rest pointing at addresses nothing listens on; and the one
endpoint change every mode applies."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address

from bench.config import (
    FAKE_NET,
    NAMESPACE,
    POD_PORTS,
    REAL_SERVICES,
    VIP_FIRST,
    VIP_NET,
    BenchError,
)
from bench.kubeproxy_rules import ServicePort


@dataclass
class ServiceSet:
    ports: list[ServicePort]  # every service port, in kube-proxy's (here: list) order
    real: list[int]  # indices of the services backed by pods
    size: int

    def real_targets(self, port_name: str) -> list[tuple[str, int]]:
        port = POD_PORTS[port_name][0]
        return [(str(VIP_NET[VIP_FIRST + i]), port) for i in self.real]


def real_positions(size: int) -> list[int]:
    """Evenly spread: with rules scanned in order, the real ones sit at every depth."""
    count = min(size, REAL_SERVICES)
    return sorted({min(size - 1, int((k + 0.5) * size / count)) for k in range(count)})


def build_services(size: int, endpoints: int, pod_ips: Sequence[str]) -> ServiceSet:
    if len(pod_ips) < endpoints:
        raise BenchError(f"{endpoints} endpoints but only {len(pod_ips)} pod addresses")
    real = real_positions(size)
    real_set = set(real)
    ports: list[ServicePort] = []
    for i in range(size):
        vip = str(VIP_NET[VIP_FIRST + i])
        name = f"svc-{i}"
        if i in real_set:
            for port_name, (port, target) in POD_PORTS.items():
                eps = tuple((ip, target) for ip in pod_ips[:endpoints])
                ports.append(ServicePort(NAMESPACE, name, port_name, "TCP", vip, port, eps))
        else:
            first = i * endpoints
            eps = tuple((str(FAKE_NET[first + j]), 8080) for j in range(endpoints))
            ports.append(ServicePort(NAMESPACE, name, "http", "TCP", vip, 80, eps))
    return ServiceSet(ports, real, size)


def changed_service(services: ServiceSet, endpoints: int) -> dict[int, ServicePort]:
    """The same change for every mode: the first endpoint of one service (all its ports) is
    replaced by a new address. A service nothing connects to when there is one. Returns the
    new version of each changed port by its index."""
    middle = len(services.ports) // 2
    index = next(
        (
            i
            for i in range(middle, len(services.ports))
            if IPv4Address(services.ports[i].endpoints[0][0]) in FAKE_NET
        ),
        middle,  # every service is a real one: change one of those, after measuring
    )
    name = services.ports[index].name
    new_ip = str(FAKE_NET[services.size * endpoints])  # past every address in use
    changed = {}
    for i, old in enumerate(services.ports):
        if old.name == name:
            changed[i] = dataclasses.replace(
                old, endpoints=((new_ip, old.endpoints[0][1]), *old.endpoints[1:])
            )
    return changed
