"""The programmer alone, against in-memory maps: what it writes, what it finds changed
behind its back, what it leaves out when the maps are too small."""

from __future__ import annotations

import dataclasses
from ipaddress import ip_address
from unittest import mock

from hypothesis import example, given, settings
from hypothesis import strategies as st

from kpr.agent import programmer as programmer_module
from kpr.agent.programmer import Programmer
from kpr.datapath import abi
from kpr.datapath.maps import MemoryMaps, consistent
from kpr.model import Backend, Frontend, FrontendState, Translation


def service(out: Translation, name: str, n: int, backends: int = 2) -> Frontend:
    frontend = Frontend(ip_address(f"10.96.0.{n}"), 80, "TCP")
    ends = tuple(Backend(ip_address(f"10.244.{n}.{b}"), 8080) for b in range(1, backends + 1))
    out.frontends[frontend] = FrontendState(f"default/{name}:http", ends)
    out.owners[frontend] = ("default", name)
    return frontend


def sizes(capacity: int) -> abi.MapSizes:
    return abi.MapSizes(**{f.name: capacity for f in dataclasses.fields(abi.MapSizes)})


def test_a_write_programs_the_desired_state_and_a_second_writes_nothing():
    maps = MemoryMaps()
    programmer = Programmer(maps, sizes(100))
    desired = Translation()
    a = service(desired, "a", 1)
    written = programmer.write(desired, None)
    assert written.writes > 0 and not written.failed
    assert maps.read().services[a].slots == programmer.programmed.services[a].slots
    assert programmer.write(desired, None).writes == 0


def test_reread_counts_what_changed_behind_its_back_and_the_next_write_repairs_it():
    maps = MemoryMaps()
    programmer = Programmer(maps, sizes(100))
    desired = Translation()
    a, b = service(desired, "a", 1), service(desired, "b", 2)
    programmer.write(desired, None)
    del maps.services[b]  # as `bpftool map delete` would
    assert programmer.reread() == 1
    assert b not in programmer.programmed.services
    assert programmer.write(desired, None).writes > 0
    assert {a, b} <= set(maps.read().services)
    assert programmer.reread() == 0


def test_services_that_do_not_fit_are_left_out_whole_and_said_why():
    maps = MemoryMaps()
    big = abi.BLOCK_SLOTS + 1  # backends whose slots are kpr_slots entries
    programmer = Programmer(maps, dataclasses.replace(sizes(100), slots=2 * big - 1))
    desired = Translation()
    service(desired, "a", 1, backends=big)
    b = service(desired, "b", 2, backends=big)  # one slot too many
    written = programmer.write(desired, None)
    assert written.left_out_now and not written.failed
    assert programmer.left_out == {b: ("default", "b")}
    assert "kpr_slots" in programmer.left_out_why
    assert b not in maps.read().services
    # the Service goes: nothing is left out any more
    del desired.frontends[b], desired.owners[b]
    written = programmer.write(desired, None)
    assert not written.left_out_now and programmer.left_out == {}
    assert programmer.left_out_why == ""


def test_failed_writes_are_reported_and_the_maps_read_again():
    maps = MemoryMaps(capacity=1)  # one entry a map: the second backend cannot be written
    programmer = Programmer(maps, sizes(100))  # (the fit check believes there is room)
    desired = Translation()
    a = service(desired, "a", 1, backends=2)
    written = programmer.write(desired, None)
    assert written.failed == {a}
    assert programmer.programmed.services == maps.read().services


def test_a_check_finds_the_maps_as_written_until_something_changes_behind_its_back():
    maps = MemoryMaps()
    programmer = Programmer(maps, sizes(100))
    desired = Translation()
    a, b = service(desired, "a", 1), service(desired, "b", 2)
    programmer.write(desired, None)
    del desired.frontends[a], desired.owners[a]
    programmer.write(desired, {a})  # a partial write keeps the maps as written too
    assert programmer.check() == [] and not programmer.plan_all
    sid = maps.services[b].service_id
    maps.blocks[sid] = maps.blocks[sid][::-1]
    assert programmer.check() == ["blocks"]
    programmer.reread()  # (what the maps hold, read: as written once more)
    assert programmer.check() == []


def test_a_failed_write_has_the_next_full_sync_plan_everything_until_one_succeeds():
    maps = MemoryMaps(capacity=1)
    programmer = Programmer(maps, sizes(100))
    desired = Translation()
    a = service(desired, "a", 1, backends=2)
    assert programmer.write(desired, {a}).failed
    assert programmer.plan_all
    programmer.write(Translation(), set())  # a partial write of nothing: still to retry
    assert programmer.plan_all
    maps.capacity = 10
    assert not programmer.write(desired, None).failed
    assert not programmer.plan_all


def _first_sync(desired: Translation, part: int, capacity: int = 1000) -> MemoryMaps:
    def check(maps: MemoryMaps) -> None:
        faults = consistent(maps)
        assert not faults, faults

    maps = MemoryMaps(check=check)
    programmer = Programmer(maps, dataclasses.replace(sizes(capacity), slots=capacity // 2))
    with mock.patch.object(programmer_module, "FIRST_SYNC_PART", part):
        written = programmer.write(desired, None)
    assert not written.failed
    assert programmer.programmed.services == maps.read().services  # as the maps hold
    return maps


@settings(max_examples=60, deadline=None)
@given(
    st.lists(  # each frontend: its backends (from a few shared), IPv6 or not
        st.tuples(st.lists(st.integers(1, 40), max_size=abi.BLOCK_SLOTS + 4), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 8),
)
@example([([1, 2], False), ([2, 3], True), (list(range(1, 21)), False)], 1)
def test_a_first_sync_in_parts_writes_what_one_plan_of_everything_would(frontends, part):
    desired = Translation()
    for n, (backends, v6) in enumerate(frontends, start=1):
        address = ip_address(f"fd00::{n:x}" if v6 else f"10.96.0.{n}")
        ends = tuple(
            Backend(ip_address(f"fd00:1::{b:x}" if v6 else f"10.244.0.{b}"), 8080) for b in backends
        )
        frontend = Frontend(address, 80, "TCP")
        desired.frontends[frontend] = FrontendState(f"default/s{n}:http", ends)
        desired.owners[frontend] = ("default", f"s{n}")
    whole, in_parts = _first_sync(desired, 10**9), _first_sync(desired, part)
    assert in_parts._tables() == whole._tables()


def test_a_first_sync_in_parts_leaves_out_what_does_not_fit_as_one_plan_would():
    desired = Translation()
    big = abi.BLOCK_SLOTS + 1  # backends whose slots are kpr_slots entries
    for n in range(1, 5):
        service(desired, f"s{n}", n, backends=big)
    whole, in_parts = _first_sync(desired, 10**9, 70), _first_sync(desired, 1, 70)
    assert in_parts._tables() == whole._tables()
    assert len(whole.services) == 2  # (35 slots fit twice)


def test_a_part_of_a_first_sync_that_fails_is_reported_and_the_next_parts_still_written():
    maps = MemoryMaps(capacity=2)  # a third entry does not fit (the fit check thinks it does)
    programmer = Programmer(maps, sizes(100))
    desired = Translation()
    a, b, c = (service(desired, name, n, backends=1) for n, name in enumerate("abc", start=1))
    with mock.patch.object(programmer_module, "FIRST_SYNC_PART", 1):
        written = programmer.write(desired, None)
    assert written.failed == {c}
    assert set(maps.read().services) == {a, b}
    assert programmer.programmed.services == maps.read().services
    assert programmer.plan_all  # (the next full sync plans everything again)
