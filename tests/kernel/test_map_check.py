"""A full sync's check of the maps (kpr/datapath/expected.py) against the real kernel maps:
kpr's own writes, small and large, keep them as expected; a change made behind kpr's back
(raw syscalls, as bpftool makes them) is found in the map it was made in; reading the maps
again makes what they hold the expected content."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from kpr.agent import programmer as programmer_module
from kpr.agent.programmer import Programmer
from kpr.datapath import abi, bpfsys, loader
from kpr.datapath.digest import combine, digest
from kpr.datapath.expected import array_entries
from kpr.datapath.maps import BpfMaps
from kpr.model import Backend, Frontend, FrontendState, Translation

# kpr_slots holds 16,384 slots: room for a write larger than expected.LOOKED_UP
SIZES = abi.MapSizes.for_services(4096)


@pytest.fixture
def maps(pin_dir, cgroup):
    loader.load(pin_dir, cgroup, SIZES, attach=False)
    opened = BpfMaps(pin_dir)
    opened.read()  # (what an agent does first: adopt what the maps hold)
    yield opened
    opened.close()
    loader.unpin_all(pin_dir)


def backends(first: int, count: int) -> dict[int, Backend]:
    return {
        first + i: Backend(
            ip_address(
                f"10.{(first + i) >> 16 & 255}.{(first + i) >> 8 & 255}.{(first + i) & 255}"
            ),
            80,
        )
        for i in range(count)
    }


def test_kprs_own_writes_small_and_large_keep_the_maps_as_expected(maps):
    assert maps.unverified() == []
    maps.write_backends(backends(1, 3))  # small: what they replace looked up
    maps.write_slots({7: {1: 1, 2: 2, 3: 3}})
    maps.write_slot_blocks({7: [1, 2, 3]})
    assert maps.unverified() == []
    maps.write_backends(backends(100, 5000))  # large: the map's digest before and after
    maps.write_slots({8: {slot: 100 + slot for slot in range(1, 5001)}})
    assert maps.unverified() == []
    maps.write_backends(backends(1, 2))  # the same entries again: no change
    maps.delete_backends(backends(100, 10))
    maps.delete_slots([(8, 5000), (8, 4999)])
    maps.write_slot_blocks({9000: [4, 5]})  # (a slot block far above the others)
    assert maps.unverified() == []


def test_a_change_behind_kprs_back_is_found_in_its_map_until_the_maps_are_read_again(maps):
    maps.write_backends(backends(1, 3))
    maps.write_slots({7: {1: 1, 2: 2}})
    maps.write_slot_blocks({7: [1, 2]})
    maps.maps["kpr_slots"].update_packed(abi.SLOT_KEY.pack(7, 1), abi.ID.pack(2))
    maps.maps["kpr_backends4"].update_packed(abi.ID.pack(3), bytes(8))  # (an array: zeroed)
    maps.maps["kpr_slot_blocks"].update_packed(abi.ID.pack(7), abi.SLOT_BLOCK.pack(*[0] * 16))
    maps.maps["kpr_revnat6"].update_packed(abi.ID.pack(5), abi.BACKEND6.pack(bytes(16), 80))
    assert sorted(maps.unverified() or []) == sorted(
        ["kpr_slots", "kpr_backends4", "kpr_slot_blocks", "kpr_revnat6"]
    )
    maps.read()
    assert maps.unverified() == []
    # a change to a source range (an LPM trie: a set of keys)
    maps.maps["kpr_source_ranges"].update_packed(
        abi.SOURCE_RANGE_KEY.pack(32 + 8, 7, bytes([10, 0, 0, 0]) + bytes(12)), b"\x01"
    )
    assert maps.unverified() == ["kpr_source_ranges"]


def test_a_check_stops_when_asked_and_the_next_goes_on_from_there(maps):
    # (a hash map of two batch reads: the arrays are mmapped, read at once)
    maps.write_slots({1: {slot: 2 for slot in range(1, 12001)}})
    asked = []

    def interrupted() -> bool:
        asked.append(1)
        return len(asked) == 2

    assert maps.unverified(interrupted) is None
    maps.maps["kpr_slots"].update_packed(abi.SLOT_KEY.pack(1, 1), abi.ID.pack(1))
    assert maps.unverified(interrupted) == ["kpr_slots"]


def test_a_change_behind_kprs_back_to_an_empty_map_is_found_after_a_large_write(maps):
    # (a write into a map expected empty looks nothing up: the check still sees the rest)
    maps.maps["kpr_backends4"].update_packed(abi.ID.pack(9999), abi.BACKEND4.pack(bytes(4), 1))
    maps.write_backends(backends(1, 5000))
    assert maps.unverified() == ["kpr_backends4"]


def test_an_mmapped_array_holds_what_its_batch_reads_return(maps):
    # (the check reads the arrays through mmap: the same entries, at the same indexes)
    maps.write_backends(backends(1, 3000))
    maps.delete_backends(backends(7, 5))  # (zeros: entries no more)
    maps.write_slot_blocks({3: [1, 2], 2000: list(range(1, 17))})
    for name in ("kpr_backends4", "kpr_slot_blocks"):
        pinned = maps.maps[name]
        size = (pinned.info.key_size, pinned.info.value_size)
        batches = combine(*(digest(k, v, *size, True) for k, v, _ in pinned.dump()))
        keys, values, count = array_entries(pinned)
        assert (count, digest(keys, values, *size, True)) == (
            {"kpr_backends4": 2995, "kpr_slot_blocks": 2}[name],
            batches,
        )
    keys, _, _ = array_entries(maps.maps["kpr_slot_blocks"])
    assert keys == abi.ID.pack(3) + abi.ID.pack(2000)


def test_writes_said_to_add_keep_the_maps_as_expected_and_a_key_there_after_all_is_found(maps):
    maps.write_backends(backends(1, 3))  # (the maps are no longer empty)
    maps.write_slots({7: {1: 1}})
    with maps.adding():  # (what they replace is not read: neither looked up nor digested)
        maps.write_backends(backends(100, 5000))
        maps.write_slots({8: {slot: 100 + slot for slot in range(1, 5001)}})
    assert maps.unverified() == []
    with maps.adding():  # a key kpr wrote before, said to be new: the check errs safe
        maps.write_backends({1: backends(9000, 1)[9000]})
    assert maps.unverified() == ["kpr_backends4"]


def test_a_first_sync_in_parts_leaves_the_maps_as_expected(maps, monkeypatch):
    monkeypatch.setattr(programmer_module, "FIRST_SYNC_PART", 3)
    desired = Translation()
    for n in range(1, 11):
        frontend = Frontend(ip_address(f"10.96.0.{n}"), 80, "TCP")
        ends = (Backend(ip_address(f"10.244.0.{n}"), 80), Backend(ip_address("10.244.1.1"), 80))
        desired.frontends[frontend] = FrontendState(f"default/s{n}:http", ends)
    programmer = Programmer(maps, SIZES)
    assert programmer.write(desired, None).writes > 0
    assert programmer.check() == []
    assert programmer.reread() == 0  # (what was written, read back)


def test_a_map_put_back_behind_kprs_back_to_bytes_a_check_found_as_expected_is_found(maps):
    # (a check that reads the same bytes as the last one takes no digest of them: the same
    # bytes count as expected only against the same expectation)
    maps.write_backends(backends(1, 3))
    maps.write_slots({7: {1: 1, 2: 2}})
    assert maps.unverified() == []
    assert maps.unverified() == []  # (the same bytes: known from their fingerprint)
    before = maps.maps["kpr_backends4"].lookup_packed(abi.ID.pack(2))
    assert before is not None
    maps.write_backends({2: backends(50, 1)[50]})
    maps.write_slots({7: {1: 2}})
    # bpftool puts back what the maps held before kpr's writes: bytes found as expected once
    maps.maps["kpr_backends4"].update_packed(abi.ID.pack(2), before)
    maps.maps["kpr_slots"].update_packed(abi.SLOT_KEY.pack(7, 1), abi.ID.pack(1))
    assert sorted(maps.unverified() or []) == ["kpr_backends4", "kpr_slots"]


def test_an_entry_added_behind_kprs_back_to_a_map_expected_empty_is_found(maps):
    # (a hash map found empty is not read again while the kernel counts no entry in it)
    assert maps.unverified() == []
    assert maps.unverified() == []
    services6 = maps.maps["kpr_services6"]
    key = abi.FRONTEND6_KEY.pack(bytes(15) + b"\x01", 80, 6, 0)
    services6.update_packed(key, bytes(services6.info.value_size))
    assert maps.unverified() == ["kpr_services6"]
    services6.delete_packed(key)  # (empty again: as expected)
    assert maps.unverified() == []


def test_on_a_kernel_whose_memlock_counts_no_entries_an_empty_map_is_read(maps, monkeypatch):
    # (before Linux 6.5 memlock does not grow with the entries: the check walks the map)
    monkeypatch.setattr(bpfsys, "memlock_counts_entries", lambda: False)
    monkeypatch.setattr(bpfsys, "memlock", lambda fd: 1 << 20)  # (fixed, as there)
    assert maps.unverified() == []
    assert maps.unverified() == []
    services6 = maps.maps["kpr_services6"]
    key = abi.FRONTEND6_KEY.pack(bytes(15) + b"\x01", 80, 6, 0)
    services6.update_packed(key, bytes(services6.info.value_size))
    assert maps.unverified() == ["kpr_services6"]
