"""The fit check: a sync that would not fit programs whole Services only, and says why."""

from __future__ import annotations

import dataclasses
from ipaddress import ip_address

from kpr.datapath import abi
from kpr.datapath.capacity import fit, plan_fits, without
from kpr.datapath.maps import MemoryMaps, consistent, execute
from kpr.datapath.plan import plan
from kpr.model import Backend, Frontend, FrontendState, Translation


def service(out: Translation, name: str, n: int, ports: int, backends: int) -> None:
    """Service default/<name>: frontends 10.96.<n>.0:80.., each with `backends` endpoints."""
    for port in range(80, 80 + ports):
        frontend = Frontend(ip_address(f"10.96.{n}.0"), port, "TCP")
        ends = tuple(Backend(ip_address(f"10.244.{n}.{b}"), 8080) for b in range(1, backends + 1))
        out.frontends[frontend] = FrontendState(f"default/{name}:p{port}", ends)
        out.owners[frontend] = ("default", name)


def sizes(capacity: int) -> abi.MapSizes:
    return abi.MapSizes(**{f.name: capacity for f in dataclasses.fields(abi.MapSizes)})


# backends of a frontend whose slots are kpr_slots entries (more than a slot block holds)
BIG = abi.BLOCK_SLOTS + 1


def slots(limit: int) -> abi.MapSizes:
    """Room for `limit` kpr_slots entries, and plenty in every other map."""
    return dataclasses.replace(sizes(1000), slots=limit)


def strict(capacity: int) -> MemoryMaps:
    def check(maps: MemoryMaps) -> None:
        faults = consistent(maps)
        assert not faults, faults

    return MemoryMaps(capacity=capacity, check=check)


def sync(maps: MemoryMaps, desired: Translation, limits: abi.MapSizes, touched=None):
    checked = fit(maps.read(), desired, limits, touched)
    steps = plan(maps.read(), without(desired, checked.left_out), checked.touched)
    result = execute(maps, steps)
    assert not result.failed, result.errors  # nothing is tried that does not fit
    return checked


def test_everything_that_fits_is_planned_as_it_was():
    desired = Translation()
    service(desired, "a", 1, ports=2, backends=3)
    checked = fit(MemoryMaps().read(), desired, abi.MapSizes())
    assert not checked.left_out and not checked.shortfalls and checked.touched is None


def test_a_desired_state_bigger_than_the_maps_programs_whole_services_only():
    maps = strict(1000)
    desired = Translation()
    for n, name in enumerate("abcdefgh", start=1):
        service(desired, name, n, ports=2, backends=BIG)  # 2 masters, 34 slots, 17 backends
    checked = sync(maps, desired, slots(110))
    programmed = maps.read().services
    # slots: 3 Services take 102 of 110; a fourth would need 136
    assert sorted(checked.left_out) == [("default", x) for x in "defgh"]
    assert checked.frontends_left_out == 10
    assert len(programmed) == 6
    for frontend, owner in desired.owners.items():  # each Service whole, or not at all
        assert (frontend in programmed) == (owner[1] in "abc")
    (short,) = [s for s in checked.shortfalls if s.map == "kpr_slots"]
    assert (short.needed, short.max_entries) == (272, 110)
    assert short.max_services == abi.services_to_fit("slots", 272)
    assert "kpr_slots needs 272 entries, max_entries 110: raise --max-services" in str(short)
    line = checked.summary()
    assert line.startswith("5 Services (10 frontends) left out")
    assert "default/d, default/e, default/f, ..." in line


def test_what_is_programmed_stays_and_new_services_wait_in_name_order():
    maps = strict(1000)
    desired = Translation()
    service(desired, "z", 1, ports=2, backends=BIG)
    sync(maps, desired, slots(110))
    service(desired, "a", 2, ports=2, backends=BIG)
    service(desired, "b", 3, ports=2, backends=BIG)
    service(desired, "c", 4, ports=2, backends=BIG)  # 4 x 34 slots: one does not fit
    checked = sync(maps, desired, slots(110))
    assert list(checked.left_out) == [("default", "c")]  # not z, the incumbent
    assert {o for f, o in desired.owners.items() if f in maps.read().services} == {
        ("default", x) for x in "zab"
    }


def test_a_partial_sync_takes_a_new_service_whole_or_not_at_all():
    maps = strict(1000)
    desired = Translation()
    service(desired, "a", 1, ports=2, backends=BIG)
    sync(maps, desired, slots(110))
    service(desired, "b", 2, ports=3, backends=BIG)
    one = next(f for f, o in desired.owners.items() if o == ("default", "b"))
    checked = sync(maps, desired, slots(110), touched={one})
    assert not checked.left_out
    assert checked.touched is not None and len(checked.touched) == 3  # all of b's
    assert len(maps.read().services) == 5
    service(desired, "c", 3, ports=2, backends=BIG)  # 34 more slots: 119 > 110
    checked = sync(maps, desired, slots(110), touched=set(list(desired.frontends)[-1:]))
    assert list(checked.left_out) == [("default", "c")] and checked.touched == set()


def test_service_ids_are_checked_against_the_slot_block_array():
    # the measured defect: services and slots raised, revnat (the id space) not
    small = dataclasses.replace(sizes(1000), revnat=4)
    desired = Translation()
    for n in range(1, 6):
        service(desired, f"s{n}", n, ports=1, backends=1)
    checked = fit(MemoryMaps().read(), desired, small)
    assert len(checked.left_out) == 2  # ids 1..3 fit an array of 4 (id 0 unused)
    assert {s.map for s in checked.shortfalls} == {"kpr_slot_blocks", "kpr_revnat4"}


def test_each_family_counts_against_its_own_map():
    desired = Translation()
    for n in range(1, 3):
        for family, address in (("v4", f"10.96.{n}.0"), ("v6", f"fd00::{n}")):
            frontend = Frontend(ip_address(address), 80, "TCP")
            desired.frontends[frontend] = FrontendState(f"default/{family}{n}:http", ())
            desired.owners[frontend] = ("default", f"{family}{n}")
    maps = MemoryMaps()
    sync(maps, desired, sizes(100))
    one_more = Frontend(ip_address("10.96.9.0"), 80, "TCP")
    desired.frontends[one_more] = FrontendState("default/z:http", ())
    desired.owners[one_more] = ("default", "z")
    # 4 masters in all, but kpr_services4 holds 2 + 1 of 3: it fits
    checked = fit(maps.read(), desired, dataclasses.replace(sizes(100), services=3))
    assert not checked.left_out and not checked.shortfalls
    checked = fit(maps.read(), desired, dataclasses.replace(sizes(100), services=2))
    assert list(checked.left_out) == [("default", "z")]
    assert [str(s) for s in checked.shortfalls] == [
        "kpr_services4 needs 3 entries, max_entries 2: raise --max-services 2 or "
        "--map-sizes services=3"
    ]


def test_the_plan_bound_passes_what_fits_and_never_what_does_not():
    """The agent's first check, from the plan's writes: a sync that writes nothing fits
    at once; a plan one slot over the maps does not (then `fit` decides)."""
    desired = Translation()
    for n, name in enumerate("abc", start=1):
        service(desired, name, n, ports=2, backends=3)  # 6 masters, 18 slots, 9 backends
    service(desired, "d", 4, ports=1, backends=BIG)  # 1 master, 17 kpr_slots entries
    maps = MemoryMaps()
    # (26 backends: ids 1..26 index the backend arrays, which need 27 entries)
    assert plan_fits(maps.read(), plan(maps.read(), desired), sizes(27))
    assert not plan_fits(maps.read(), plan(maps.read(), desired), sizes(26))
    assert not plan_fits(maps.read(), plan(maps.read(), desired), slots(16))  # 17 entries
    execute(maps, plan(maps.read(), desired))
    steady = maps.read()
    assert plan(steady, desired).is_empty() and plan_fits(steady, plan(steady, desired), sizes(27))
    service(desired, "e", 5, ports=1, backends=1)  # one more master, backend, id
    assert not plan_fits(steady, plan(steady, desired), sizes(27))
    assert plan_fits(steady, plan(steady, desired), sizes(28))
