"""kpr/datapath/abi.py must describe the same bytes as bpf/kpr.h."""

from __future__ import annotations

import ctypes as ct
import re
from ipaddress import ip_address

import pytest

from kpr import model
from kpr.datapath import abi
from kpr.datapath.loader import HOOKS
from kpr.datapath.maps import _pack_addresses, _pack_backends


def test_every_hook_function_exists_in_the_program_source():
    source = (abi.BPF_DIR / "sock_lb.c").read_text()
    for hook in HOOKS:
        assert f"int {hook.function}(struct bpf_sock_addr *ctx)" in source


def test_the_header_defines_no_constant_of_abi_py_and_uses_each():
    """kpr.h and the programs take every constant and size from abi.cflags: none is defined
    in C too (a second definition could drift), and none is passed that C does not use."""
    sources = {p.name: p.read_text() for p in sorted(abi.BPF_DIR.glob("*.[ch]"))}
    passed = set(abi.constants()) | {flag[2:].split("=")[0] for flag in abi.MapSizes().cflags()}
    defined = {
        name for text in sources.values() for name in re.findall(r"#define\s+(KPR_\w+)", text)
    }
    used = {name for text in sources.values() for name in re.findall(r"\bKPR_\w+\b", text)}
    assert passed & defined == set()
    assert passed - used == set()
    # a KPR_* name in C that is neither passed nor defined in C: a constant C lost
    enum_members = {
        name
        for text in sources.values()
        for name in re.findall(r"^\s*(KPR_\w+)\s*[=,]", text, re.M)
    }
    unknown = used - passed - defined - enum_members - {"KPR_PIN_DIR"}
    assert {name for name in unknown if not name.endswith("_")} == set()


def test_constants_handed_to_the_compile_are_abi_py_s():
    flags = abi.cflags(abi.BPF_DIR, abi.MapSizes())
    assert f"-DKPR_ABI_VERSION={abi.ABI_VERSION}" in flags
    assert f"-DKPR_BLOCK_SLOTS={abi.BLOCK_SLOTS}" in flags
    assert f"-DKPR_SCOPE_SOCKET={model.SOCKET}" in flags
    assert f"-DKPR_SCOPE_EXTERNAL={model.EXTERNAL}" in flags
    assert f"-DKPR_SVC_F_SOURCE_RANGES={abi.SVC_F_SOURCE_RANGES}" in flags
    assert f"-DKPR_STAT_MAX={abi.STAT_MAX}" in flags
    assert f"-DKPR_SERVICES_MAX={abi.MapSizes().services}" in flags
    assert f"v{abi.ABI_VERSION}_" == abi.PIN_PREFIX
    assert all(spec.pin.startswith(abi.PIN_PREFIX) for spec in abi.MAPS.values())
    header = (abi.BPF_DIR / "kpr.h").read_text()
    assert '#define KPR_PIN(name) KPR_PIN_DIR "/v" KPR_STR(KPR_ABI_VERSION) "_" name' in header


def test_the_services_maps_hold_one_master_per_frontend_and_slots_are_family_free():
    """ABI v2 on: a services key is the frontend alone (no slot); a frontend's slots, of
    both families, are keyed by its service id."""
    assert abi.ABI_VERSION >= 2
    assert [name for name, *_ in abi.Frontend4Key._fields_] == [
        "address",
        "port",
        "protocol",
        "scope",
    ]
    assert [name for name, *_ in abi.SlotKey._fields_] == ["service_id", "slot"]
    assert abi.MAPS["kpr_slots"].value is ct.c_uint32  # the backend id
    assert abi.MAPS["kpr_slots"].size == "slots"
    assert f"-DKPR_SLOTS_MAX={abi.MapSizes().slots}" in abi.MapSizes().cflags()
    assert abi.MapSizes.parse("slots=4096").slots == 4096


def test_maps_indexed_by_ids_kpr_gives_out_are_arrays():
    """ABI v3: IPv4 backends by backend id, IPv4 reverse entries and slot blocks by
    service id are arrays (mmapped by the full sync's check)."""
    assert abi.ABI_VERSION == 3
    arrays = {n for n, s in abi.MAPS.items() if s.map_type == abi.BPF_MAP_TYPE_ARRAY}
    indexed = {"kpr_backends4", "kpr_revnat4", "kpr_slot_blocks"}
    assert indexed <= arrays
    header = (abi.BPF_DIR / "kpr.h").read_text()
    for name in indexed:
        declared = header[header.index(f" {name},") :].split(";")[0]
        assert "BPF_F_MMAPABLE" in declared, name


def test_struct_formats_pack_the_same_bytes_as_the_ctypes_mirror():
    v4, v6 = bytes([10, 96, 0, 10]), bytes(range(16))
    key4 = abi.Frontend4Key(address=(ct.c_uint8 * 4)(*v4), port=80, protocol=6, scope=1)
    assert abi.FRONTEND4_KEY.pack(v4, 80, 6, 1) == bytes(key4)
    key6 = abi.Frontend6Key(address=(ct.c_uint8 * 16)(*v6), port=53, protocol=17)
    assert abi.FRONTEND6_KEY.pack(v6, 53, 17, 0) == bytes(key6)
    value = abi.ServiceValue(count=2, service_id=9, flags=1, affinity_timeout=60)
    assert abi.SERVICE_VALUE.pack(2, 9, 1, 60) == bytes(value)
    assert abi.SLOT_KEY.pack(9, 3) == bytes(abi.SlotKey(service_id=9, slot=3))
    device = abi.Device((ct.c_uint8 * 4)(*v4), (ct.c_uint8 * 16)(*v6))
    assert abi.DEVICE.pack(v4, v6) == bytes(device)
    key = abi.SourceRangeKey(56, 9, (ct.c_uint8 * 16)(*v4))
    assert abi.SOURCE_RANGE_KEY.pack(56, 9, v4) == bytes(key)
    assert abi.NODE_PORT_KEY.pack(30080, 6) == bytes(abi.NodePortKey(30080, 6))
    assert abi.BACKEND4.pack(v4, 8080) == bytes(abi.Backend4((ct.c_uint8 * 4)(*v4), 8080))
    assert abi.BACKEND6.pack(v6, 8080) == bytes(abi.Backend6((ct.c_uint8 * 16)(*v6), 8080))
    ids = list(range(1, abi.BLOCK_SLOTS + 1))
    assert abi.SLOT_BLOCK.pack(*ids) == bytes(abi.SlotBlock((ct.c_uint32 * abi.BLOCK_SLOTS)(*ids)))


def test_the_default_sizes_hold_65536_services_of_10_endpoints_with_room():
    sizes = abi.MapSizes()
    assert sizes == abi.MapSizes.for_services(abi.MAX_SERVICES) == abi.MapSizes.for_services(65536)
    services, endpoints = 65536, 10  # ClusterIP, one port, IPv4: one frontend each
    assert sizes.services > services  # kpr_services4
    assert sizes.revnat > services  # service ids 1..65536 index the slot blocks too
    # slots of frontends with more than 16 backends (the rest are in slot blocks): a
    # tenth of the Services with 20 endpoints each
    assert sizes.slots > services // 10 * 20
    assert sizes.backends > services * endpoints  # distinct endpoints


def test_a_raised_knob_raises_every_service_dependent_size_consistently():
    small, big = abi.MapSizes.for_services(65536), abi.MapSizes.for_services(100_000)
    for name in ("services", "backends", "revnat", "slots", "affinity", "source_ranges"):
        assert getattr(big, name) > getattr(small, name), name
    for sizes in (small, big, abi.MapSizes.for_services(7)):
        # the id space holds every frontend of both families: never smaller than services
        assert sizes.revnat >= sizes.services
        # (kpr_slots: a fifth of every frontend's slots, the rest in slot blocks)
        assert 5 * sizes.slots >= sizes.services * abi.ENDPOINTS_PER_SERVICE
    assert big.services >= 100_000 and big.revnat >= 100_000  # the measured defect


def test_map_sizes_override_single_derived_sizes_and_the_start_up_line_says_so():
    sizes = abi.MapSizes.for_services(100_000, "slots=4096")
    assert sizes.slots == 4096
    assert sizes.revnat == abi.derive_sizes(100_000)["revnat"]
    line = sizes.describe(100_000)
    assert line.startswith("map sizes for 100000 Services x 10 endpoints")
    assert "--map-sizes overrides slots=4096 (derived 400000)" in line
    assert "overrides" not in abi.MapSizes().describe(abi.MAX_SERVICES)
    with pytest.raises(ValueError, match="--max-services"):
        abi.MapSizes.for_services(0)


def test_services_to_fit_is_the_smallest_knob_that_holds_the_entries():
    for name, needed in (("revnat", 100_000), ("slots", 1_000_001), ("backends", 3)):
        knob = abi.services_to_fit(name, needed)
        assert knob is not None
        assert abi.derive_sizes(knob)[name] >= needed
        assert knob == 1 or abi.derive_sizes(knob - 1)[name] < needed
    assert abi.services_to_fit("ct", 10**6) is None  # not derived from the knob


def test_a_pins_version_is_read_from_its_name_alone():
    assert abi.pin_version(abi.PIN_PREFIX + "services4") == abi.ABI_VERSION
    assert abi.pin_version("v1_sock_peer") == 1
    assert abi.pin_version("retired_v1_ct") is None  # set aside, not a version's pin
    assert abi.pin_version("vx_ct") is None and abi.pin_version("v2") is None


def test_ipv4_backends_packed_at_once_are_the_bytes_abi_packs_one_by_one():
    entries = {
        bid: model.Backend(ip_address(address), port)
        for bid, (address, port) in enumerate(
            [("10.0.0.1", 80), ("255.254.253.252", 65535), ("0.0.0.1", 1), ("192.168.7.9", 8080)],
            start=1,
        )
    }
    entries[1 << 31] = model.Backend(ip_address("1.2.3.4"), 443)  # (a high id)
    assert _pack_backends(entries) == _pack_addresses("backends", entries)
