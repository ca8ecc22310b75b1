"""The node's devices and addresses: where the TC program goes and where NodePorts answer.

`kpr run --devices eth0,eth1` names the devices (a name with `*`, `?` or `[` is a
pattern: every device it matches, also one that appears later); without it
(`auto`), the devices the default routes leave through and those holding the
Node's InternalIPs. NodePorts, LoadBalancer IPs and external IPs are served there.

A flow masqueraded to a backend on another node may leave by any other device (a
second NIC, an overlay: VXLAN, Geneve, IPIP, WireGuard), with that device's address
as its source, as iptables' MASQUERADE does; its replies come back there. So the TC
program is also on every other device with an address, for those replies only.

Everything is read from the current network namespace, so `ip netns exec NODE kpr
run ...` serves a node that lives in a namespace; the agent follows changes at run
time (DeviceWatch).
"""

from __future__ import annotations

import fnmatch
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from ipaddress import ip_address, ip_network

from kpr.model import IPAddress
from kpr.node.host import SetupError
from kpr.node.rtnetlink import Rtnl

log = logging.getLogger(__name__)

AUTO = "auto"
NONE = "none"
IFF_LOOPBACK = 0x8
NETLINK_ROUTE = 0
RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR = 0x1, 0x10, 0x100  # rtnetlink.h
PATTERN_CHARACTERS = "*?["


@dataclass(frozen=True)
class Device:
    name: str
    index: int
    addresses: tuple[IPAddress, ...] = field(default=())  # global unicast, primary first
    loopback: bool = False

    def first(self, version: int) -> IPAddress | None:
        return next((a for a in self.addresses if a.version == version), None)


def read_devices() -> tuple[dict[str, Device], set[str]]:
    """Every link of this namespace with its global addresses; and the names of
    those the default routes leave through."""
    with Rtnl() as rtnl:
        links = rtnl.links()
        names = {index: name for index, name, _ in links}
        loopback = {index for index, _, flags in links if flags & IFF_LOOPBACK}
        addresses: dict[int, list[IPAddress]] = {index: [] for index in names}
        for index, scope, packed in rtnl.addresses():
            if scope != 0:  # RT_SCOPE_UNIVERSE only: not link-local, not host
                continue
            addresses.setdefault(index, []).append(ip_address(packed))
        default = {
            names[out]
            for family in (socket.AF_INET, socket.AF_INET6)
            for out in rtnl.default_route_devices(family)
            if out in names
        }
    devices = {
        name: Device(name, index, tuple(addresses.get(index, ())), index in loopback)
        for index, name in names.items()
    }
    return devices, default


def is_pattern(name: str) -> bool:
    return any(c in name for c in PATTERN_CHARACTERS)


def select_devices(
    spec: str,
    devices: dict[str, Device],
    default: Iterable[str],
    node_addresses: Iterable[IPAddress] = (),
    strict: bool = True,
) -> list[Device]:
    """`--devices` → the devices; SetupError naming an unknown one (`strict`: at start;
    at run time a named device that is gone is left out). `auto` takes the devices the
    default routes leave through and those holding `node_addresses` (the Node's
    InternalIPs)."""
    if spec == NONE or spec == "":
        return []
    if spec == AUTO:
        wanted = set(node_addresses)
        holding = {d.name for d in devices.values() if wanted & set(d.addresses)}
        return [devices[name] for name in sorted(set(default) | holding) if name in devices]
    chosen: list[Device] = []
    for name in (part.strip() for part in spec.split(",")):
        if is_pattern(name):
            chosen += [d for n, d in sorted(devices.items()) if fnmatch.fnmatchcase(n, name)]
        elif name in devices:
            chosen.append(devices[name])
        elif strict:
            known = ", ".join(sorted(devices))
            raise SetupError(
                f"--devices: there is no device {name!r} in this network namespace "
                f"(there are: {known}). Name existing devices, or leave --devices out "
                f"to use those the default routes leave through."
            )
    return list(dict.fromkeys(chosen))  # unique, in order


def reply_devices(devices: dict[str, Device], chosen: Iterable[Device]) -> list[Device]:
    """The other devices a masqueraded flow may leave by, where its replies come back:
    every one with an address (the one it is masqueraded to), but loopback."""
    taken = {d.index for d in chosen}
    return [
        d
        for _, d in sorted(devices.items())
        if d.addresses and not d.loopback and d.index not in taken
    ]


@dataclass(frozen=True)
class DeviceChoice:
    """Where the TC program is: `serve` (--devices: frontends served there) and
    `replies` (the replies of masqueraded flows only)."""

    serve: tuple[Device, ...] = ()
    replies: tuple[Device, ...] = ()

    @property
    def names(self) -> list[str]:
        return [d.name for d in (*self.serve, *self.replies)]

    def node_address(self, version: int) -> IPAddress | None:
        """The node's address of a family: the first served device's first one."""
        return next((a for d in self.serve if (a := d.first(version)) is not None), None)


def choose_devices(
    spec: str, node_addresses: Iterable[IPAddress] = (), strict: bool = True
) -> DeviceChoice:
    """The devices of this network namespace for `--devices` now."""
    devices, default = read_devices()
    serve = select_devices(spec, devices, default, node_addresses, strict)
    replies = reply_devices(devices, serve) if serve else []
    return DeviceChoice(tuple(serve), tuple(replies))


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


class DeviceWatch:
    """Netlink link and address events of this network namespace: `changed` is set when
    a device or an address came, went or changed, so the agent reads the devices again.
    Which change it was does not matter: the devices are read whole, so the messages
    are not parsed, and an overrun (ENOBUFS) means the same."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self.changed = threading.Event()
        self.on_change = on_change  # called after `changed` is set (the agent's run loop wakes)
        self._closed = threading.Event()
        # bound before the agent reads the devices: nothing between is missed
        self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self._socket.bind((0, RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
        self._wake_r, self._wake_w = socket.socketpair()  # `close` ends the wait at once
        self._thread = threading.Thread(target=self._run, name="device-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            select.select([self._socket, self._wake_r], [], [])  # (no polling: asleep until one)
            if self._closed.is_set():
                return
            try:
                self._socket.recv(65536)
            except OSError as err:  # ENOBUFS: events were lost; read the devices anyway
                if self._closed.is_set():
                    return
                log.info("netlink device events: %s; reading the devices again", err)
            self.changed.set()
            self.on_change()

    def close(self) -> None:
        self._closed.set()
        self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for end in (self._socket, self._wake_r, self._wake_w):
            end.close()
