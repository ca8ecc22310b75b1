"""The node's devices and addresses: where the TC program goes and where NodePorts answer.

`kpr run --devices eth0,eth1` names the devices; without it, the devices the
default routes leave through (the ones holding the node's addresses on a
typical node). Everything is read from the current network namespace, so
`ip netns exec NODE kpr run ...` serves a node that lives in a namespace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network

from kpr.host import SetupError
from kpr.model import IPAddress

AUTO = "auto"
NONE = "none"


@dataclass(frozen=True)
class Device:
    name: str
    index: int
    addresses: tuple[IPAddress, ...] = field(default=())  # global unicast, primary first

    def first(self, version: int) -> IPAddress | None:
        return next((a for a in self.addresses if a.version == version), None)


def read_devices() -> tuple[dict[str, Device], set[str]]:
    """Every link of this namespace with its global addresses; and the names of
    those the default routes leave through."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        addresses: dict[int, list[IPAddress]] = {index: [] for index in names}
        for message in ipr.get_addr():
            if message["scope"] != 0:  # RT_SCOPE_UNIVERSE only: not link-local, not host
                continue
            address = ip_address(message.get_attr("IFA_ADDRESS"))
            addresses.setdefault(message["index"], []).append(address)
        default = set()
        for family in (2, 10):  # AF_INET, AF_INET6
            for route in ipr.get_default_routes(family=family):
                out = route.get_attr("RTA_OIF")
                if out in names:
                    default.add(names[out])
    devices = {
        name: Device(name, index, tuple(addresses.get(index, ()))) for index, name in names.items()
    }
    return devices, default


def select_devices(spec: str, devices: dict[str, Device], default: Iterable[str]) -> list[Device]:
    """`--devices` → the devices; SetupError naming an unknown one."""
    if spec == NONE or spec == "":
        return []
    if spec == AUTO:
        return [devices[name] for name in sorted(default) if name in devices]
    chosen = []
    for name in (part.strip() for part in spec.split(",")):
        if name not in devices:
            known = ", ".join(sorted(devices))
            raise SetupError(
                f"--devices: there is no device {name!r} in this network namespace "
                f"(there are: {known}). Name existing devices, or leave --devices out "
                f"to use those the default routes leave through."
            )
        chosen.append(devices[name])
    return chosen


def node_port_addresses(devices: list[Device], cidrs: list[str]) -> tuple[IPAddress, ...]:
    """The addresses NodePorts are served on: the devices' addresses, narrowed by
    kube-proxy's nodePortAddresses (CIDRs, or "primary": each family's first)."""
    if cidrs == ["primary"]:
        primary = [d.first(v) for v in (4, 6) for d in devices[:1]]
        return tuple(a for a in primary if a is not None)
    addresses = [a for device in devices for a in device.addresses]
    if cidrs:
        networks = [ip_network(c, strict=False) for c in cidrs]
        addresses = [a for a in addresses if any(a in n for n in networks)]
    return tuple(dict.fromkeys(addresses))  # unique, in order
