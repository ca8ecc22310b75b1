"""The Python mirror of kpr/bpf/kpr.h: struct layouts, map names, constants.

kpr/bpf/kpr.h is the source of truth; tests/kernel/test_abi.py checks these ctypes
layouts against the types BCC compiles from it. Change both together.
"""

from __future__ import annotations

import ctypes as ct
import dataclasses
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

ABI_VERSION = 1

BPF_DIR = Path(__file__).resolve().parents[1] / "bpf"  # package data, installed with kpr

PROTOCOL_NUMBERS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP}
PROTOCOL_NAMES = {v: k for k, v in PROTOCOL_NUMBERS.items()}

# enum kpr_outcome
STAT_NAMES = {
    0: "translated",
    1: "no_backend",
    2: "backend_missing",
    3: "reversed",
    4: "revnat_full",
    5: "external_translated",
    6: "external_rejected",
    7: "external_dropped",
}
STAT_MAX = 8

# struct kpr_service.flags
SVC_F_SOURCE_RANGES = 1 << 0
SVC_F_DROP = 1 << 1


# Addresses: bytes in network order. Ports: host order (bpftool shows them plainly).
class Service4Key(ct.Structure):
    _fields_ = [
        ("address", ct.c_uint8 * 4),
        ("port", ct.c_uint16),
        ("protocol", ct.c_uint8),
        ("scope", ct.c_uint8),
        ("slot", ct.c_uint32),  # was a 16-bit slot and padding: the same bytes below 65,536
    ]


class Service6Key(ct.Structure):
    _fields_ = [
        ("address", ct.c_uint8 * 16),
        ("port", ct.c_uint16),
        ("protocol", ct.c_uint8),
        ("scope", ct.c_uint8),
        ("slot", ct.c_uint32),
    ]


class ServiceValue(ct.Structure):
    _fields_ = [
        ("backend_id", ct.c_uint32),
        ("count", ct.c_uint32),
        ("service_id", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("affinity_timeout", ct.c_uint32),
        ("pad", ct.c_uint32),
    ]


class Backend4(ct.Structure):
    _fields_ = [("address", ct.c_uint8 * 4), ("port", ct.c_uint16), ("pad", ct.c_uint16)]


class Backend6(ct.Structure):
    _fields_ = [("address", ct.c_uint8 * 16), ("port", ct.c_uint16), ("pad", ct.c_uint16)]


# struct kpr_revnat4/6 share the backend layouts: an address and a port.
RevNat4 = Backend4
RevNat6 = Backend6


class SockRevNat4Key(ct.Structure):
    _fields_ = [
        ("cookie", ct.c_uint64),
        ("address", ct.c_uint8 * 4),
        ("port", ct.c_uint16),
        ("pad", ct.c_uint16),
    ]


class SockRevNat6Key(ct.Structure):
    _fields_ = [
        ("cookie", ct.c_uint64),
        ("address", ct.c_uint8 * 16),
        ("port", ct.c_uint16),
        ("pad", ct.c_uint16),
        ("pad2", ct.c_uint32),
    ]


BLOCK_SLOTS = 16  # KPR_BLOCK_SLOTS


class SlotBlock(ct.Structure):
    _fields_ = [("backend_ids", ct.c_uint32 * BLOCK_SLOTS)]


class SockPeer(ct.Structure):
    _fields_ = [
        ("service_address", ct.c_uint8 * 16),
        ("backend_address", ct.c_uint8 * 16),
        ("service_port", ct.c_uint16),
        ("backend_port", ct.c_uint16),
        ("pad", ct.c_uint32),
    ]


class SockPeerSlot(ct.Structure):
    _fields_ = [("cookie", ct.c_uint64), ("peer", SockPeer)]


class AffinityKey(ct.Structure):
    _fields_ = [("netns_cookie", ct.c_uint64), ("service_id", ct.c_uint32), ("pad", ct.c_uint32)]


class Affinity(ct.Structure):
    _fields_ = [
        ("last_used_ns", ct.c_uint64),
        ("backend_id", ct.c_uint32),
        ("slot", ct.c_uint32),
    ]


# --- TC datapath (kpr/bpf/nodeport.c) ---


class FlowKey(ct.Structure):
    _fields_ = [
        ("saddr", ct.c_uint8 * 16),
        ("daddr", ct.c_uint8 * 16),
        ("sport", ct.c_uint16),
        ("dport", ct.c_uint16),
        ("protocol", ct.c_uint8),
        ("family", ct.c_uint8),
        ("pad", ct.c_uint16),
    ]


CT_F_SNAT = 1 << 0


class Ct(ct.Structure):
    _fields_ = [
        ("backend_address", ct.c_uint8 * 16),
        ("nat_address", ct.c_uint8 * 16),
        ("backend_port", ct.c_uint16),
        ("nat_port", ct.c_uint16),
        ("backend_id", ct.c_uint32),
        ("service_id", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("last_seen_ns", ct.c_uint64),
    ]


class Nat(ct.Structure):
    _fields_ = [
        ("frontend_address", ct.c_uint8 * 16),
        ("client_address", ct.c_uint8 * 16),
        ("frontend_port", ct.c_uint16),
        ("client_port", ct.c_uint16),
        ("flags", ct.c_uint32),
        ("last_seen_ns", ct.c_uint64),
    ]


DEVICE_F_REPLIES = 1 << 0  # KPR_DEVICE_F_REPLIES: only masqueraded flows' replies there
NODE_ADDRESS_INDEX = 0  # the kpr_devices entry of the node's address (no device has index 0)


class Device(ct.Structure):
    _fields_ = [
        ("address4", ct.c_uint8 * 4),
        ("address6", ct.c_uint8 * 16),
        ("flags", ct.c_uint32),
    ]


class AffinityExtKey(ct.Structure):
    _fields_ = [("address", ct.c_uint8 * 16), ("service_id", ct.c_uint32)]


class SourceRangeKey(ct.Structure):
    _fields_ = [
        ("prefixlen", ct.c_uint32),
        ("service_id", ct.c_uint32),
        ("address", ct.c_uint8 * 16),
    ]


class NodePortKey(ct.Structure):
    _fields_ = [("port", ct.c_uint16), ("protocol", ct.c_uint8), ("pad", ct.c_uint8)]


class Config(ct.Structure):
    _fields_ = [("node_netns_cookie", ct.c_uint64)]


class LocalEndpointKey(ct.Structure):
    _fields_ = [("address", ct.c_uint8 * 16), ("family", ct.c_uint8), ("pad", ct.c_uint8 * 3)]


@dataclass(frozen=True)
class MapSpec:
    """A pinned map: its name in C, its pin name, and the sizes kpr expects."""

    name: str  # the C name in kpr.h
    pin: str  # file name under the pin directory
    map_type: int  # BPF_MAP_TYPE_*
    key: type[ct.Structure] | type[ct._SimpleCData]
    value: type[ct.Structure] | type[ct._SimpleCData]
    size: str | int  # the -D that sets max_entries, or a fixed max_entries

    @property
    def key_size(self) -> int:
        return ct.sizeof(self.key)

    @property
    def value_size(self) -> int:
        return ct.sizeof(self.value)


BPF_MAP_TYPE_HASH = 1
BPF_MAP_TYPE_ARRAY = 2
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_MAP_TYPE_LRU_HASH = 9
BPF_MAP_TYPE_LPM_TRIE = 11


def _spec(name: str, map_type: int, key, value, size: str | int) -> MapSpec:
    short = name.removeprefix("kpr_")
    return MapSpec(name, f"v{ABI_VERSION}_{short}", map_type, key, value, size)


MAPS: dict[str, MapSpec] = {
    s.name: s
    for s in (
        _spec("kpr_services4", BPF_MAP_TYPE_HASH, Service4Key, ServiceValue, "KPR_SERVICE_MAX"),
        _spec("kpr_services6", BPF_MAP_TYPE_HASH, Service6Key, ServiceValue, "KPR_SERVICE_MAX"),
        _spec("kpr_backends4", BPF_MAP_TYPE_HASH, ct.c_uint32, Backend4, "KPR_BACKEND_MAX"),
        _spec("kpr_backends6", BPF_MAP_TYPE_HASH, ct.c_uint32, Backend6, "KPR_BACKEND_MAX"),
        _spec("kpr_revnat4", BPF_MAP_TYPE_HASH, ct.c_uint32, RevNat4, "KPR_REVNAT_MAX"),
        _spec("kpr_revnat6", BPF_MAP_TYPE_HASH, ct.c_uint32, RevNat6, "KPR_REVNAT_MAX"),
        _spec(
            "kpr_sock_revnat4",
            BPF_MAP_TYPE_LRU_HASH,
            SockRevNat4Key,
            RevNat4,
            "KPR_SOCK_REVNAT_MAX",
        ),
        _spec(
            "kpr_sock_revnat6",
            BPF_MAP_TYPE_LRU_HASH,
            SockRevNat6Key,
            RevNat6,
            "KPR_SOCK_REVNAT_MAX",
        ),
        _spec(
            "kpr_sock_peers",
            BPF_MAP_TYPE_ARRAY,
            ct.c_uint32,
            SockPeerSlot,
            "KPR_SOCK_PEERS_MAX",
        ),
        # indexed by service id, like the revnat maps: as many entries
        _spec("kpr_slot_blocks", BPF_MAP_TYPE_ARRAY, ct.c_uint32, SlotBlock, "KPR_REVNAT_MAX"),
        _spec("kpr_affinity", BPF_MAP_TYPE_LRU_HASH, AffinityKey, Affinity, "KPR_AFFINITY_MAX"),
        _spec("kpr_stats", BPF_MAP_TYPE_PERCPU_ARRAY, ct.c_uint32, ct.c_uint64, STAT_MAX),
        _spec("kpr_ct", BPF_MAP_TYPE_LRU_HASH, FlowKey, Ct, "KPR_CT_MAX"),
        _spec("kpr_nat", BPF_MAP_TYPE_LRU_HASH, FlowKey, Nat, "KPR_CT_MAX"),
        _spec("kpr_devices", BPF_MAP_TYPE_HASH, ct.c_uint32, Device, 256),
        _spec(
            "kpr_affinity_ext",
            BPF_MAP_TYPE_LRU_HASH,
            AffinityExtKey,
            Affinity,
            "KPR_AFFINITY_MAX",
        ),
        _spec(
            "kpr_source_ranges",
            BPF_MAP_TYPE_LPM_TRIE,
            SourceRangeKey,
            ct.c_uint8,
            "KPR_SOURCE_RANGE_MAX",
        ),
        _spec("kpr_node_ports", BPF_MAP_TYPE_HASH, NodePortKey, ct.c_uint8, 65536),
        _spec("kpr_config", BPF_MAP_TYPE_ARRAY, ct.c_uint32, Config, 1),
        _spec("kpr_local_endpoints", BPF_MAP_TYPE_HASH, LocalEndpointKey, ct.c_uint8, 65536),
    )
}


# Maps added to this ABI version after its first release: a pin directory of an older
# build lacks them until the agent of this one compiles (and so creates) them.
ADDED_MAPS = {"kpr_config", "kpr_local_endpoints"}

# socket local storage (kpr_sock_peer): no entries to read or size, but pinned like the rest
SOCK_PEER_PIN = f"v{ABI_VERSION}_sock_peer"

MAP_PRESSURE = 0.9  # a map this full is reported (log, `kpr status`) before writes fail


@dataclass(frozen=True)
class MapSizes:
    """max_entries of the maps; configurable, fixed once the maps are pinned."""

    services: int = 524288  # masters + slots: 30,000 services x 10 endpoints fit
    backends: int = 524288  # 30,000 services x 10 distinct endpoints fit
    revnat: int = 65536
    sock_revnat: int = 65536  # LRU: preallocated, so kept modest
    # ring of connected sockets' service addresses (48 bytes a slot): getpeername shows the
    # service until this many newer connects through Services reuse the slot
    sock_peers: int = 262144
    affinity: int = 65536  # LRU: (client netns, service) pairs with ClientIP affinity
    ct: int = 65536  # LRU, each of kpr_ct and kpr_nat: external flows through TC
    source_ranges: int = 16384  # loadBalancerSourceRanges, all Services together

    @classmethod
    def parse(cls, text: str) -> MapSizes:
        """ "services=1048576,backends=524288" → MapSizes; ValueError naming the bad part."""
        sizes = {}
        for part in text.split(","):
            name, _, value = part.partition("=")
            name = name.strip()
            if name not in cls.__dataclass_fields__:
                known = ", ".join(cls.__dataclass_fields__)
                raise ValueError(f"--map-sizes: unknown map {name!r} (known: {known})")
            if not value.strip().isdigit() or not 1 <= int(value) <= 1 << 26:
                raise ValueError(f"--map-sizes: {name}={value!r} is not a size (1 to 67108864)")
            sizes[name] = int(value)
        return dataclasses.replace(cls(), **sizes)

    def max_entries(self, spec: MapSpec) -> int:
        if isinstance(spec.size, int):
            return spec.size
        return {
            "KPR_SERVICE_MAX": self.services,
            "KPR_BACKEND_MAX": self.backends,
            "KPR_REVNAT_MAX": self.revnat,
            "KPR_SOCK_REVNAT_MAX": self.sock_revnat,
            "KPR_SOCK_PEERS_MAX": self.sock_peers,
            "KPR_AFFINITY_MAX": self.affinity,
            "KPR_CT_MAX": self.ct,
            "KPR_SOURCE_RANGE_MAX": self.source_ranges,
        }[spec.size]

    def cflags(self) -> list[str]:
        return [
            f"-DKPR_SERVICE_MAX={self.services}",
            f"-DKPR_BACKEND_MAX={self.backends}",
            f"-DKPR_REVNAT_MAX={self.revnat}",
            f"-DKPR_SOCK_REVNAT_MAX={self.sock_revnat}",
            f"-DKPR_SOCK_PEERS_MAX={self.sock_peers}",
            f"-DKPR_AFFINITY_MAX={self.affinity}",
            f"-DKPR_CT_MAX={self.ct}",
            f"-DKPR_SOURCE_RANGE_MAX={self.source_ranges}",
        ]


# struct-module formats of the same layouts, for packing many entries fast
# (tests/unit/datapath/test_abi.py checks each against its ctypes mirror).
SERVICE4_KEY = struct.Struct("<4sHBBI")  # address, port, protocol, scope, slot
SERVICE6_KEY = struct.Struct("<16sHBBI")
SERVICE_VALUE = struct.Struct("<IIIIIxxxx")  # backend_id, count, service_id, flags, affinity
BACKEND4 = struct.Struct("<4sHxx")  # address, port; also struct kpr_revnat4
BACKEND6 = struct.Struct("<16sHxx")
ID = struct.Struct("<I")
SLOT_BLOCK = struct.Struct(f"<{BLOCK_SLOTS}I")  # struct kpr_slot_block
DEVICE = struct.Struct("<4s16sxxxx")  # address4, address6 (flags zero)
DEVICE_FLAGS = struct.Struct("<4s16sI")  # address4, address6, flags
SOURCE_RANGE_KEY = struct.Struct("<II16s")  # prefixlen, service_id, address
NODE_PORT_KEY = struct.Struct("<HBx")  # port, protocol
CONFIG = struct.Struct("<Q")  # struct kpr_config: node_netns_cookie
LOCAL_ENDPOINT_KEY = struct.Struct("<16sB3x")  # address (IPv4 in the first 4 bytes), family
