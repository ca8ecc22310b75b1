"""The kernel/user ABI as Python sees it: constants, map sizes, struct layouts, map names.

The constants and map sizes are defined here only: `cflags()` and `MapSizes.cflags()`
hand them to the C compile as -D flags (bpf/kpr.h defines none of them). The
struct layouts are written twice, as C in bpf/kpr.h and as ctypes here;
tests/kernel/test_abi.py checks the ctypes layouts against the types BCC compiles, so
change both together. The `struct` formats used to pack many entries fast are
computed from the ctypes classes (`layout`), never written by hand.
"""

from __future__ import annotations

import ctypes as ct
import dataclasses
import importlib.resources
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from kpr import model

# a changed layout gets a new version, and so new pins. 3: the IPv4 backend and reverse
# maps are arrays kpr mmaps, indexed by ids it reuses (2: hash maps; the services maps hold
# masters only, slots keyed by service id; 1: slots in the services maps, keyed by the
# frontend and the slot)
ABI_VERSION = 3
PIN_PREFIX = f"v{ABI_VERSION}_"  # every pin of this version starts so (kpr.h: KPR_PIN)


def pin_version(name: str) -> int | None:
    """The ABI version a pin's name carries (`v<N>_...`); None: not a versioned pin."""
    version, _, rest = name.partition("_")
    if rest and version[:1] == "v" and version[1:].isdigit():
        return int(version[1:])
    return None


# the programs' C sources, the package kpr.bpf: bpf/ in a checkout (pyproject.toml maps it,
# for an editable install too), kpr/bpf/ once installed
BPF_DIR = Path(str(importlib.resources.files("kpr.bpf")))

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
STAT_MAX = len(STAT_NAMES)

# struct kpr_service.flags
SVC_F_SOURCE_RANGES = 1 << 0
SVC_F_DROP = 1 << 1


# Addresses: bytes in network order. Ports: host order (bpftool shows them plainly).
class Frontend4Key(ct.Structure):
    """struct kpr_frontend4_key: a kpr_services4 key, one per frontend (its master)."""

    _fields_ = [
        ("address", ct.c_uint8 * 4),
        ("port", ct.c_uint16),
        ("protocol", ct.c_uint8),
        ("scope", ct.c_uint8),
    ]


class Frontend6Key(ct.Structure):
    _fields_ = [
        ("address", ct.c_uint8 * 16),
        ("port", ct.c_uint16),
        ("protocol", ct.c_uint8),
        ("scope", ct.c_uint8),
    ]


class ServiceValue(ct.Structure):
    """struct kpr_service: a frontend's master entry."""

    _fields_ = [
        ("count", ct.c_uint32),
        ("service_id", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("affinity_timeout", ct.c_uint32),
    ]


class SlotKey(ct.Structure):
    """struct kpr_slot_key: a kpr_slots key; the value is the slot's backend id (__u32)."""

    _fields_ = [("service_id", ct.c_uint32), ("slot", ct.c_uint32)]


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


BLOCK_SLOTS = 16  # a frontend with at most this many backends has a struct kpr_slot_block


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


# --- TC datapath (bpf/nodeport.c) ---


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
    size: str | int  # the MapSizes field that sets max_entries, or a fixed max_entries

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
    return MapSpec(name, PIN_PREFIX + short, map_type, key, value, size)


# fixed max_entries (not --map-sizes knobs), handed to kpr.h like the others
DEVICES_MAX = 256  # kpr_devices: the node's devices, and index 0
NODE_PORTS_MAX = 65536  # kpr_node_ports: every port of both protocols
LOCAL_ENDPOINTS_MAX = 65536  # kpr_local_endpoints


MAPS: dict[str, MapSpec] = {
    s.name: s
    for s in (
        _spec("kpr_services4", BPF_MAP_TYPE_HASH, Frontend4Key, ServiceValue, "services"),
        _spec("kpr_services6", BPF_MAP_TYPE_HASH, Frontend6Key, ServiceValue, "services"),
        _spec("kpr_slots", BPF_MAP_TYPE_HASH, SlotKey, ct.c_uint32, "slots"),
        # (IPv4: arrays, ids index them below their max_entries; kpr.h says why not IPv6)
        _spec("kpr_backends4", BPF_MAP_TYPE_ARRAY, ct.c_uint32, Backend4, "backends"),
        _spec("kpr_backends6", BPF_MAP_TYPE_HASH, ct.c_uint32, Backend6, "backends"),
        _spec("kpr_revnat4", BPF_MAP_TYPE_ARRAY, ct.c_uint32, RevNat4, "revnat"),
        _spec("kpr_revnat6", BPF_MAP_TYPE_HASH, ct.c_uint32, RevNat6, "revnat"),
        _spec(
            "kpr_sock_revnat4",
            BPF_MAP_TYPE_LRU_HASH,
            SockRevNat4Key,
            RevNat4,
            "sock_revnat",
        ),
        _spec(
            "kpr_sock_revnat6",
            BPF_MAP_TYPE_LRU_HASH,
            SockRevNat6Key,
            RevNat6,
            "sock_revnat",
        ),
        _spec(
            "kpr_sock_peers",
            BPF_MAP_TYPE_ARRAY,
            ct.c_uint32,
            SockPeerSlot,
            "sock_peers",
        ),
        # indexed by service id, like the revnat maps: as many entries
        _spec("kpr_slot_blocks", BPF_MAP_TYPE_ARRAY, ct.c_uint32, SlotBlock, "revnat"),
        _spec("kpr_affinity", BPF_MAP_TYPE_LRU_HASH, AffinityKey, Affinity, "affinity"),
        _spec("kpr_stats", BPF_MAP_TYPE_PERCPU_ARRAY, ct.c_uint32, ct.c_uint64, STAT_MAX),
        _spec("kpr_ct", BPF_MAP_TYPE_LRU_HASH, FlowKey, Ct, "ct"),
        _spec("kpr_nat", BPF_MAP_TYPE_LRU_HASH, FlowKey, Nat, "ct"),
        _spec("kpr_devices", BPF_MAP_TYPE_HASH, ct.c_uint32, Device, DEVICES_MAX),
        _spec(
            "kpr_affinity_ext",
            BPF_MAP_TYPE_LRU_HASH,
            AffinityExtKey,
            Affinity,
            "affinity",
        ),
        _spec(
            "kpr_source_ranges",
            BPF_MAP_TYPE_LPM_TRIE,
            SourceRangeKey,
            ct.c_uint8,
            "source_ranges",
        ),
        _spec("kpr_node_ports", BPF_MAP_TYPE_HASH, NodePortKey, ct.c_uint8, NODE_PORTS_MAX),
        _spec("kpr_config", BPF_MAP_TYPE_ARRAY, ct.c_uint32, Config, 1),
        _spec(
            "kpr_local_endpoints",
            BPF_MAP_TYPE_HASH,
            LocalEndpointKey,
            ct.c_uint8,
            LOCAL_ENDPOINTS_MAX,
        ),
    )
}


# Maps added to this ABI version after its first release: a pin directory of an older
# build lacks them until the agent of this one compiles (and so creates) them.
ADDED_MAPS: set[str] = set()

# socket local storage (kpr_sock_peer): no entries to read or size, but pinned like the rest
SOCK_PEER_PIN = PIN_PREFIX + "sock_peer"

MAP_PRESSURE = 0.9  # a map this full is reported (log, `kpr status`) before writes fail


# The one capacity knob (`kpr run --max-services`): every Service-dependent map size
# follows from it in `derive_sizes`, on these assumptions
MAX_SERVICES = 65536
ENDPOINTS_PER_SERVICE = 10  # distinct endpoints of a Service, on average
# frontends (ports x families x scopes) of a Service, on average: a one-port ClusterIP
# Service has one, so 2 leaves room for a second port, a family or a NodePort
FRONTENDS_PER_SERVICE = 2
# connection-dependent maps (LRU rings of sockets and flows) do not follow the knob
_FIXED = {"sock_revnat": 65536, "sock_peers": 262144, "ct": 65536}


def derive_sizes(max_services: int) -> dict[str, int]:
    """max_entries of every MapSizes field for `max_services` Services. Service ids are
    shared by both families and both scopes, and index the slot blocks: the id space
    (`revnat`) holds every frontend, so it is never smaller than `services`."""
    frontends = max_services * FRONTENDS_PER_SERVICE
    endpoints = max_services * ENDPOINTS_PER_SERVICE
    return {
        "services": frontends,  # each of kpr_services4/6
        # each family; a quarter more for endpoints replaced during one sync (a backend
        # is deleted after the slots that named it are rewritten). Backend ids (of both
        # families, one id space) index the IPv4 array: dual-stack needs twice as many
        "backends": endpoints + endpoints // 4,
        "revnat": frontends,  # service ids of both families: kpr_revnat4/6, slot blocks
        "sock_revnat": _FIXED["sock_revnat"],
        "sock_peers": _FIXED["sock_peers"],
        "affinity": max_services,  # LRU: (client netns, service) pairs
        "ct": _FIXED["ct"],
        "source_ranges": max(max_services // 4, 1),  # loadBalancerSourceRanges, all together
        # kpr_slots, both families: the slots of frontends with more than BLOCK_SLOTS
        # backends only (a smaller frontend's are in its slot block), room for a fifth of
        # every frontend's. Its buckets are walked at each check, even empty
        "slots": frontends * ENDPOINTS_PER_SERVICE // 5,
    }


def services_to_fit(name: str, needed: int) -> int | None:
    """The smallest --max-services whose derived size of map field `name` holds `needed`
    entries; None: that map does not follow the knob (raise it with --map-sizes)."""
    if name in _FIXED:
        return None
    low, high = 1, 1
    while derive_sizes(high)[name] < needed:
        high *= 2
    while low < high:  # (the sizes grow with the knob: bisect)
        mid = (low + high) // 2
        if derive_sizes(mid)[name] >= needed:
            high = mid
        else:
            low = mid + 1
    return low


_DEFAULT = derive_sizes(MAX_SERVICES)


@dataclass(frozen=True)
class MapSizes:
    """max_entries of the maps; configurable, fixed once the maps are pinned. The
    defaults are `derive_sizes(MAX_SERVICES)`: 65,536 Services of 10 endpoints fit."""

    services: int = _DEFAULT["services"]  # frontends (master entries) of each family
    backends: int = _DEFAULT["backends"]
    revnat: int = _DEFAULT["revnat"]  # service ids, both families: also the slot blocks
    sock_revnat: int = _DEFAULT["sock_revnat"]  # LRU: preallocated, so kept modest
    # ring of connected sockets' service addresses (48 bytes a slot): getpeername shows the
    # service until this many newer connects through Services reuse the slot
    sock_peers: int = _DEFAULT["sock_peers"]
    affinity: int = _DEFAULT["affinity"]  # LRU: (client netns, service) pairs with ClientIP
    ct: int = _DEFAULT["ct"]  # LRU, each of kpr_ct and kpr_nat: external flows through TC
    source_ranges: int = _DEFAULT["source_ranges"]  # loadBalancerSourceRanges, all Services
    # kpr_slots, every frontend's backend slots, both families together (last, so the
    # fields before keep their positions)
    slots: int = _DEFAULT["slots"]

    @classmethod
    def for_services(cls, max_services: int, overrides: str | None = None) -> MapSizes:
        """The sizes derived from the knob, then `overrides` ("name=N,...", --map-sizes)
        in place of the derived ones; ValueError naming a bad part."""
        if not 1 <= max_services <= 1 << 21:  # (the derived sizes stay within 1 << 26)
            raise ValueError(f"--max-services: {max_services} is not 1 to 2097152")
        derived = cls(**derive_sizes(max_services))
        return dataclasses.replace(derived, **cls._overrides(overrides)) if overrides else derived

    def describe(self, max_services: int) -> str:
        """One line for the start-up log: the knob, the derived sizes, what overrides them."""
        derived = derive_sizes(max_services)
        sizes = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        changed = [
            f"{f.name}={getattr(self, f.name)} (derived {derived[f.name]})"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != derived[f.name]
        ]
        return (
            f"map sizes for {max_services} Services x {ENDPOINTS_PER_SERVICE} endpoints "
            f"({FRONTENDS_PER_SERVICE} frontends each): {sizes}"
            + (f"; --map-sizes overrides {', '.join(changed)}" if changed else "")
        )

    @classmethod
    def parse(cls, text: str) -> MapSizes:
        """ "services=1048576,backends=524288" → MapSizes; ValueError naming the bad part."""
        return dataclasses.replace(cls(), **cls._overrides(text))

    @classmethod
    def _overrides(cls, text: str) -> dict[str, int]:
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
        return sizes

    def max_entries(self, spec: MapSpec) -> int:
        return spec.size if isinstance(spec.size, int) else getattr(self, spec.size)

    def cflags(self) -> list[str]:
        """-DKPR_<FIELD>_MAX=<entries> for each field (kpr.h sizes its maps with them)."""
        return [
            f"-DKPR_{f.name.upper()}_MAX={getattr(self, f.name)}" for f in dataclasses.fields(self)
        ]


def constants() -> dict[str, int]:
    """The constants bpf/kpr.h and the programs use, by their C names."""
    out = {
        "KPR_ABI_VERSION": ABI_VERSION,
        "KPR_BLOCK_SLOTS": BLOCK_SLOTS,
        "KPR_SVC_F_SOURCE_RANGES": SVC_F_SOURCE_RANGES,
        "KPR_SVC_F_DROP": SVC_F_DROP,
        "KPR_SCOPE_SOCKET": model.SOCKET,  # the frontend key's scope: Frontend.scope
        "KPR_SCOPE_EXTERNAL": model.EXTERNAL,
        "KPR_CT_F_SNAT": CT_F_SNAT,
        "KPR_DEVICE_F_REPLIES": DEVICE_F_REPLIES,
        "KPR_DEVICES_MAX": DEVICES_MAX,
        "KPR_NODE_PORTS_MAX": NODE_PORTS_MAX,
        "KPR_LOCAL_ENDPOINTS_MAX": LOCAL_ENDPOINTS_MAX,
        "KPR_STAT_MAX": STAT_MAX,
    }
    out.update({f"KPR_STAT_{name.upper()}": index for index, name in STAT_NAMES.items()})
    return out


def cflags(pin_dir: Path, sizes: MapSizes) -> list[str]:
    """Everything the C compile takes from here: constants, map sizes, the pin directory."""
    flags = [f"-I{BPF_DIR}", f'-DKPR_PIN_DIR="{pin_dir}"']
    flags += [f"-D{name}={value}" for name, value in constants().items()]
    return flags + sizes.cflags()


# --- struct-module formats computed from the ctypes layouts -----------------------

_CODES: dict[type, str] = {ct.c_uint8: "B", ct.c_uint16: "H", ct.c_uint32: "I", ct.c_uint64: "Q"}


def layout(
    ctype: type[ct.Structure], zero: tuple[str, ...] = (), before: str | None = None
) -> struct.Struct:
    """A little-endian `struct` format of the same bytes as `ctype`: one value per field in
    C order (a byte array is one bytes value, another array one value per element), none
    for fields named pad* or listed in `zero` (packed as zero bytes), and zero bytes for
    the gaps the C alignment leaves. `before`: only the fields before that one (a key's
    prefix). Packing many entries with it is several times faster than filling ctypes
    instances."""
    fmt, end = "<", 0
    for name, ftype, *_ in ctype._fields_:
        if name == before:
            return struct.Struct(fmt)
        field = getattr(ctype, name)
        if field.offset > end:
            fmt += f"{field.offset - end}x"
        end = field.offset + field.size
        if name.startswith("pad") or name in zero:
            fmt += f"{field.size}x"
        elif issubclass(ftype, ct.Array) and ftype._type_ is ct.c_uint8:
            fmt += f"{ftype._length_}s"
        elif issubclass(ftype, ct.Array):
            fmt += f"{ftype._length_}{_CODES[ftype._type_]}"  # type: ignore[index]
        else:
            fmt += _CODES[ftype]  # a nested struct or another type: KeyError, add it here
    if ct.sizeof(ctype) > end:
        fmt += f"{ct.sizeof(ctype) - end}x"
    packed = struct.Struct(fmt)
    assert packed.size == ct.sizeof(ctype), (ctype, fmt)
    return packed


# for packing and unpacking many entries fast (the field order of each is its C struct's)
FRONTEND4_KEY = layout(Frontend4Key)  # address, port, protocol, scope
FRONTEND6_KEY = layout(Frontend6Key)
SERVICE_VALUE = layout(ServiceValue)  # count, service_id, flags, affinity_timeout
SLOT_KEY = layout(SlotKey)  # service_id, slot
BACKEND4 = layout(Backend4)  # address, port; also struct kpr_revnat4
BACKEND6 = layout(Backend6)
ID = struct.Struct("<I")  # a __u32 key: backend id, service id, ifindex, array index
SLOT_BLOCK = layout(SlotBlock)  # backend_ids
DEVICE = layout(Device, zero=("flags",))  # address4, address6 (flags zero)
DEVICE_FLAGS = layout(Device)  # address4, address6, flags
SOURCE_RANGE_KEY = layout(SourceRangeKey)  # prefixlen, service_id, address
NODE_PORT_KEY = layout(NodePortKey)  # port, protocol
CONFIG = layout(Config)  # node_netns_cookie
LOCAL_ENDPOINT_KEY = layout(LocalEndpointKey)  # address (IPv4 in the first 4 bytes), family
FLOW_KEY = layout(FlowKey)  # saddr, daddr, sport, dport, protocol, family
# backend_address, nat_address, backend_port, nat_port, backend_id, service_id, flags,
# last_seen_ns
CT = layout(Ct)
