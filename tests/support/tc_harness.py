"""A lab for running bpf/nodeport.c through BPF_PROG_TEST_RUN.

One throwaway network namespace plays the node; nothing is sent anywhere. The
programs run on crafted frames in that namespace (the test run uses the calling
thread's namespace, which `Lab.inside()` switches with setns), so bpf_fib_lookup
sees the lab's devices and routes:

    ext0 (node device, in kpr_devices)  192.0.2.1/24          2001:db8:1::1/64
      clients  198.51.100.0/24 via 192.0.2.254 (neighbour known)
               203.0.113.0/24  via 192.0.2.253 (neighbour unknown: bpf_redirect_neigh)
               2001:db8:c::/64 via 2001:db8:1::fe
      remote pods 10.244.1.0/24 via 192.0.2.2, fd00:10:244:1::/64 via 2001:db8:1::2
    pod0 (a local pod's veth, not in kpr_devices)  10.244.0.1/24  fd00:10:244::1/64
      local pods 10.244.0.0/24, fd00:10:244::/64 (neighbours known)
    ext1 (a second NIC, or an overlay device)  198.18.0.1/24  2001:db8:18::1/64
      remote pods 10.244.2.0/24 via 198.18.0.2, fd00:10:244:2::/64 via 2001:db8:18::2
    bare0 (a device without addresses, e.g. WireGuard)
      remote pods 10.244.3.0/24, fd00:10:244:3::/64 on the link

The other ends of the veth pairs stay in the namespace, down to nothing but up.
"""

from __future__ import annotations

import contextlib
import ctypes as ct
import ipaddress
import os
import shutil
import struct
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kpr import model
from kpr.datapath import abi, bpfsys, tc
from kpr.node import host

CLONE_NEWNET = 0x40000000
_libc = ct.CDLL(None, use_errno=True)

SCOPE_SOCKET = model.SOCKET
SCOPE_EXTERNAL = model.EXTERNAL

TC_ACT_UNSPEC = -1
TC_ACT_OK = 0
TC_ACT_SHOT = 2
TC_ACT_REDIRECT = 7

NODE_MAC = "02:00:00:00:00:01"
CLIENT_MAC = "02:00:00:00:00:c1"
GW_MAC = "02:00:00:00:00:fe"
OTHER_NODE_MAC = "02:00:00:00:00:02"
POD_MAC = "02:00:00:00:00:a0"
PEER_MAC = "02:00:00:00:00:03"  # the other end of ext1 and bare0

NODE4, NODE6 = "192.0.2.1", "2001:db8:1::1"
GW4, GW6 = "192.0.2.254", "2001:db8:1::fe"
OTHER_NODE4, OTHER_NODE6 = "192.0.2.2", "2001:db8:1::2"
CLIENT4, CLIENT6 = "198.51.100.7", "2001:db8:c::7"
CLIENT4_NO_NEIGH = "203.0.113.7"  # routed via 192.0.2.253, whose MAC is not known
LOCAL_POD4, LOCAL_POD6 = "10.244.0.10", "fd00:10:244::10"
REMOTE_POD4, REMOTE_POD6 = "10.244.1.20", "fd00:10:244:1::20"
EXT1_4, EXT1_6 = "198.18.0.1", "2001:db8:18::1"
SECOND_NIC_POD4, SECOND_NIC_POD6 = "10.244.2.20", "fd00:10:244:2::20"  # routed via ext1
BARE_POD4, BARE_POD6 = "10.244.3.30", "fd00:10:244:3::30"  # routed via bare0
# this node's pods: the agent puts their addresses in kpr_local_endpoints (nodeName)
LOCAL_NETS = (ipaddress.ip_network("10.244.0.0/24"), ipaddress.ip_network("fd00:10:244::/64"))

_SETUP = """
link add ext0 address {node_mac} type veth peer name ext0p
link add pod0 type veth peer name pod0p
link add ext1 address {node_mac} type veth peer name ext1p
link add bare0 address {node_mac} type veth peer name bare0p
link set ext1 up
link set ext1p up
link set bare0 up
link set bare0p up
addr add 198.18.0.1/24 dev ext1
addr add 2001:db8:18::1/64 dev ext1 nodad
route add 10.244.2.0/24 via 198.18.0.2 dev ext1
route add fd00:10:244:2::/64 via 2001:db8:18::2 dev ext1
neigh add 198.18.0.2 lladdr {peer_mac} dev ext1 nud permanent
neigh add 2001:db8:18::2 lladdr {peer_mac} dev ext1 nud permanent
route add 10.244.3.0/24 dev bare0
route add fd00:10:244:3::/64 dev bare0
neigh add 10.244.3.30 lladdr {peer_mac} dev bare0 nud permanent
neigh add fd00:10:244:3::30 lladdr {peer_mac} dev bare0 nud permanent
link set lo up
link set ext0 up
link set ext0p up
link set pod0 up
link set pod0p up
addr add 192.0.2.1/24 dev ext0
addr add 2001:db8:1::1/64 dev ext0 nodad
addr add 10.244.0.1/24 dev pod0
addr add fd00:10:244::1/64 dev pod0 nodad
route add 198.51.100.0/24 via 192.0.2.254 dev ext0
route add 203.0.113.0/24 via 192.0.2.253 dev ext0
route add 10.244.1.0/24 via 192.0.2.2 dev ext0
route add 2001:db8:c::/64 via 2001:db8:1::fe dev ext0
route add fd00:10:244:1::/64 via 2001:db8:1::2 dev ext0
neigh add 192.0.2.254 lladdr {gw_mac} dev ext0 nud permanent
neigh add 2001:db8:1::fe lladdr {gw_mac} dev ext0 nud permanent
neigh add 192.0.2.2 lladdr {other_mac} dev ext0 nud permanent
neigh add 2001:db8:1::2 lladdr {other_mac} dev ext0 nud permanent
neigh add 10.244.0.10 lladdr {pod_mac} dev pod0 nud permanent
neigh add fd00:10:244::10 lladdr {pod_mac} dev pod0 nud permanent
"""


def setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        code = ct.get_errno()
        raise OSError(code, f"setns: {os.strerror(code)}")


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """Run the calling thread in network namespace `netns` (of `ip netns`) for a while."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        setns(target)
        try:
            yield
        finally:
            setns(home)
    finally:
        os.close(target)
        os.close(home)


def addr16(address: str) -> bytes:
    """An address as kpr's flow keys hold it: 16 bytes, IPv4 in the first 4."""
    return ipaddress.ip_address(address).packed.ljust(16, b"\0")


def addr_bytes(address: str) -> bytes:
    return ipaddress.ip_address(address).packed


def family(address: str) -> int:
    return ipaddress.ip_address(address).version


@dataclass(frozen=True)
class Frontend:
    address: str
    port: int
    protocol: int  # 6 / 17


class Lab:
    """The node namespace, the compiled programs and their maps."""

    def __init__(self) -> None:
        self.netns = f"kpr-tc-{uuid.uuid4().hex[:8]}"
        self.pin_dir = Path("/sys/fs/bpf") / f"kpr-tc-test-{uuid.uuid4().hex[:8]}"
        self.bpf = None
        self.fds: dict[str, int] = {}
        self.ifindex: dict[str, int] = {}
        self._next_id = 1

    # --- set-up and tear-down ---

    def start(self) -> Lab:
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        commands = _SETUP.format(
            node_mac=NODE_MAC,
            gw_mac=GW_MAC,
            other_mac=OTHER_NODE_MAC,
            pod_mac=POD_MAC,
            peer_mac=PEER_MAC,
        )
        batch = "\n".join(line for line in commands.splitlines() if line.strip()) + "\n"
        subprocess.run(
            ["ip", "-n", self.netns, "-batch", "-"],
            input=batch,
            text=True,
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                "sysctl",
                "-q",
                "-w",
                "net.ipv4.conf.all.forwarding=1",
                "net.ipv6.conf.all.forwarding=1",
            ],
            check=True,
        )
        with self.inside():
            for name in ("ext0", "pod0", "ext1", "bare0", "lo"):
                self.ifindex[name] = socket_if_nametoindex(name)
        host.ensure_bpffs(self.pin_dir)
        self.bpf = tc.compile_and_pin(
            self.pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024, 1024, 1024)
        )
        for direction in tc.DIRECTIONS:
            self.fds[direction.name] = bpfsys.obj_get(tc.prog_pin(self.pin_dir, direction))
        return self

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.bpf = None
        subprocess.run(["ip", "netns", "del", self.netns], check=False, capture_output=True)
        shutil.rmtree(self.pin_dir, ignore_errors=True)

    def inside(self) -> contextlib.AbstractContextManager[None]:
        """Run the calling thread in the lab's namespace for a while."""
        return inside(self.netns)

    # --- running the programs ---

    def run(self, direction: str, frame: bytes, device: str = "ext0") -> bpfsys.ProgRun:
        index = self.ifindex[device]
        ctx = bpfsys.skb_ctx(ifindex=index, ingress_ifindex=index)
        with self.inside():
            return bpfsys.prog_test_run(self.fds[direction], frame, ctx)

    def ingress(self, frame: bytes, device: str = "ext0") -> bpfsys.ProgRun:
        return self.run("ingress", frame, device)

    def egress(self, frame: bytes, device: str = "ext0") -> bpfsys.ProgRun:
        return self.run("egress", frame, device)

    # --- maps ---

    def table(self, name: str):
        return self.bpf[name.encode()]

    def put(self, name: str, key, value) -> None:
        table = self.table(name)
        table[table.Key.from_buffer_copy(bytes(key))] = table.Leaf.from_buffer_copy(bytes(value))

    def get(self, name: str, key, value_type):
        table = self.table(name)
        try:
            value = table[table.Key.from_buffer_copy(bytes(key))]
        except KeyError:
            return None
        return value_type.from_buffer_copy(bytes(value))

    def entries(self, name: str, key_type, value_type) -> list:
        return [
            (key_type.from_buffer_copy(bytes(k)), value_type.from_buffer_copy(bytes(v)))
            for k, v in self.table(name).items()
        ]

    def reset(self) -> None:
        """Empty every map kpr_tc_* reads (between tests)."""
        for name in (
            "kpr_services4",
            "kpr_services6",
            "kpr_slots",
            "kpr_backends4",
            "kpr_backends6",
            "kpr_ct",
            "kpr_nat",
            "kpr_devices",
            "kpr_affinity_ext",
            "kpr_source_ranges",
            "kpr_local_endpoints",
        ):
            table = self.table(name)
            for key in list(table.keys()):
                with contextlib.suppress(KeyError):
                    del table[key]
        stats = self.table("kpr_stats")
        for i in range(abi.STAT_MAX):
            stats[stats.Key(i)] = stats.Leaf(*([0] * len(stats.Leaf())))
        self.set_devices({"ext0": (NODE4, NODE6)})

    def stat(self, name: str) -> int:
        index = {v: k for k, v in abi.STAT_NAMES.items()}[name]
        stats = self.table("kpr_stats")
        return sum(stats[stats.Key(index)])

    def set_devices(self, devices: dict[str, tuple]) -> None:
        """kpr_devices by device name: (IPv4, IPv6[, flags]); "node": the node's address."""
        index = {**self.ifindex, "node": abi.NODE_ADDRESS_INDEX}
        with self.inside():
            tc.write_devices(self.pin_dir, {index[name]: value for name, value in devices.items()})

    def add_service(
        self,
        frontend: Frontend,
        backends: list[tuple[str, int]],
        scope: int = SCOPE_EXTERNAL,
        flags: int = 0,
        affinity_timeout: int = 0,
    ) -> int:
        """Program one frontend with its backends (as the agent would); its service id."""
        service_id = self._next_id
        self._next_id += 1
        v6 = family(frontend.address) == 6
        services = "kpr_services6" if v6 else "kpr_services4"
        ids = []
        for address, port in backends:
            backend_id = self._next_id
            self._next_id += 1
            backend_type = abi.Backend6 if v6 else abi.Backend4
            backend = backend_type(port=port)
            if any(ipaddress.ip_address(address) in net for net in LOCAL_NETS):
                key = abi.LocalEndpointKey(family=family(address))
                ct.memmove(key.address, addr_bytes(address), len(addr_bytes(address)))
                self.put("kpr_local_endpoints", key, ct.c_uint8(1))
            ct.memmove(backend.address, addr_bytes(address), len(addr_bytes(address)))
            self.put("kpr_backends6" if v6 else "kpr_backends4", ct.c_uint32(backend_id), backend)
            ids.append(backend_id)
        for slot, backend_id in enumerate(ids, start=1):
            self.set_slot(service_id, slot, backend_id)
        master = abi.ServiceValue(
            count=len(ids), service_id=service_id, flags=flags, affinity_timeout=affinity_timeout
        )
        self.put(services, self.frontend_key(frontend, scope), master)
        return service_id

    def set_slot(self, service_id: int, slot: int, backend_id: int) -> None:
        """Slot `slot` of the frontend with that service id names `backend_id` (kpr_slots;
        no slot block is written, so the programs read this entry)."""
        self.put("kpr_slots", abi.SlotKey(service_id, slot), ct.c_uint32(backend_id))

    def set_block(self, service_id: int, backend_ids: list[int]) -> None:
        """The slot block of that service id (kpr_slot_blocks); 0s send readers to kpr_slots."""
        ids = backend_ids + [0] * (abi.BLOCK_SLOTS - len(backend_ids))
        block = abi.SlotBlock((ct.c_uint32 * abi.BLOCK_SLOTS)(*ids))
        self.put("kpr_slot_blocks", ct.c_uint32(service_id), block)

    @staticmethod
    def frontend_key(frontend: Frontend, scope: int = SCOPE_EXTERNAL):
        raw = addr_bytes(frontend.address)
        if len(raw) == 16:
            return abi.Frontend6Key(
                address=(ct.c_uint8 * 16)(*raw),
                port=frontend.port,
                protocol=frontend.protocol,
                scope=scope,
            )
        return abi.Frontend4Key(
            address=(ct.c_uint8 * 4)(*raw),
            port=frontend.port,
            protocol=frontend.protocol,
            scope=scope,
        )

    def master(self, frontend: Frontend) -> abi.ServiceValue:
        services = "kpr_services6" if family(frontend.address) == 6 else "kpr_services4"
        return self.get(services, self.frontend_key(frontend), abi.ServiceValue)

    def backend_ids(self, frontend: Frontend) -> list[int]:
        master = self.master(frontend)
        return [
            self.get("kpr_slots", abi.SlotKey(master.service_id, slot), ct.c_uint32).value
            for slot in range(1, master.count + 1)
        ]

    def delete_backend(self, backend_id: int, v6: bool) -> None:
        table = self.table("kpr_backends6" if v6 else "kpr_backends4")
        del table[table.Key(backend_id)]

    def allow_source(self, service_id: int, cidr: str) -> None:
        net = ipaddress.ip_network(cidr)
        key = abi.SourceRangeKey(prefixlen=32 + net.prefixlen, service_id=service_id)
        ct.memmove(key.address, net.network_address.packed, len(net.network_address.packed))
        self.put("kpr_source_ranges", key, ct.c_uint8(1))


def flow_key(saddr: str, daddr: str, sport: int, dport: int, protocol: int) -> abi.FlowKey:
    key = abi.FlowKey(sport=sport, dport=dport, protocol=protocol, family=family(saddr))
    ct.memmove(key.saddr, addr16(saddr), 16)
    ct.memmove(key.daddr, addr16(daddr), 16)
    return key


def socket_if_nametoindex(name: str) -> int:
    import socket

    return socket.if_nametoindex(name)


# --- checksums, as a receiver verifies them ---


def _fold(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


@dataclass(frozen=True)
class Layout:
    """Where an Ethernet/IP/L4 frame's parts are (None when it is not one)."""

    version: int
    l3_len: int
    protocol: int
    l4: bytes  # from the L4 header to the IP packet's end (padding excluded)
    saddr: bytes
    daddr: bytes


def layout(frame: bytes) -> Layout | None:
    if len(frame) < 14:
        return None
    ethertype = struct.unpack_from("!H", frame, 12)[0]
    ip = frame[14:]
    if ethertype == 0x0800 and len(ip) >= 20 and ip[0] >> 4 == 4:
        ihl = (ip[0] & 0xF) * 4
        total = struct.unpack_from("!H", ip, 2)[0]
        if ihl < 20 or total < ihl or total > len(ip):
            return None
        return Layout(4, ihl, ip[9], ip[ihl:total], ip[12:16], ip[16:20])
    if ethertype == 0x86DD and len(ip) >= 40 and ip[0] >> 4 == 6:
        total = 40 + struct.unpack_from("!H", ip, 4)[0]
        if total > len(ip):
            return None
        return Layout(6, 40, ip[6], ip[40:total], ip[8:24], ip[24:40])
    return None


def ip_header_residual(frame: bytes) -> int | None:
    """The IPv4 header's checksum residual: 0xffff when it verifies."""
    parts = layout(frame)
    if parts is None or parts.version != 4:
        return None
    return _fold(frame[14 : 14 + parts.l3_len])


def l4_residual(frame: bytes) -> int | None:
    """The TCP/UDP/ICMP(v6) checksum residual over pseudo-header and segment:
    0xffff when it verifies; None for what has no checksum to verify."""
    parts = layout(frame)
    if parts is None:
        return None
    if parts.protocol == 1 and parts.version == 4:  # ICMP: no pseudo-header
        return _fold(parts.l4)
    if parts.protocol not in (6, 17, 58):
        return None
    minimum = {6: 20, 17: 8, 58: 4}[parts.protocol]
    if len(parts.l4) < minimum:
        return None
    if parts.protocol == 17 and parts.version == 4 and parts.l4[6:8] == b"\0\0":
        return None  # UDP over IPv4 without a checksum
    length = len(parts.l4)
    if parts.version == 4:
        pseudo = parts.saddr + parts.daddr + struct.pack("!BBH", 0, parts.protocol, length)
    else:
        pseudo = parts.saddr + parts.daddr + struct.pack("!I3xB", length, parts.protocol)
    return _fold(pseudo + parts.l4)


def checksums_valid(frame: bytes) -> bool:
    ip = ip_header_residual(frame)
    l4 = l4_residual(frame)
    return ip in (None, 0xFFFF) and l4 in (None, 0xFFFF)
