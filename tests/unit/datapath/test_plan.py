"""Planning and ordered writes, against the in-memory maps (no root needed)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kpr.datapath import abi
from kpr.datapath import plan as plan_module
from kpr.datapath.maps import MemoryMaps, WriteResult, consistent, execute
from kpr.datapath.plan import BackendTable, RefCounts, apply_plan, assign_slots, plan
from kpr.model import Backend, Backends, Frontend, FrontendState, Translation


def fe(n: int, protocol: str = "TCP") -> Frontend:
    return Frontend(ip_address(f"10.96.0.{n}"), 80, protocol)


def be(n: int) -> Backend:
    return Backend(ip_address(f"10.244.0.{n}"), 8080)


def want(**frontends: list[int]) -> Translation:
    """want(a=[1, 2]) -> frontend 10.96.0.1 with backends .1 and .2, b -> .2, ..."""
    out = Translation()
    for name, backends in frontends.items():
        n = ord(name) - ord("a") + 1
        out.frontends[fe(n)] = FrontendState(f"default/{name}", tuple(be(b) for b in backends))
    return out


def strict_maps() -> MemoryMaps:
    def check(maps: MemoryMaps) -> None:
        faults = consistent(maps)
        assert not faults, faults

    return MemoryMaps(check=check)


def sync(maps: MemoryMaps, translation: Translation) -> int:
    steps = plan(maps.read(), translation)
    result = execute(maps, steps)
    assert not result.failed
    return steps.writes()


def assert_blocks_match_slots(maps: MemoryMaps) -> None:
    """Once a plan is written, each frontend's slots are in one place, as its count says:
    a small frontend's in its slot block (its prefix: a block keeps the tail of a larger
    count), a larger one's in kpr_slots only, and its block cleared."""
    for frontend, service in maps.read().services.items():
        sid, count = service.service_id, len(service.slots)
        block = maps.blocks.get(sid, [])
        in_slots = [maps.slots.get((sid, i)) for i in range(1, count + 1)]
        if count <= abi.BLOCK_SLOTS:
            assert (block[:count], in_slots) == (service.slots, [None] * count), frontend
        else:
            assert (any(block), in_slots) == (False, service.slots), frontend


def served(maps: MemoryMaps) -> dict[Frontend, set[Backend]]:
    state = maps.read()
    return {f: {state.backends[b] for b in s.slots} for f, s in state.services.items()}


def test_new_services_are_written_and_readable():
    maps = strict_maps()
    sync(maps, want(a=[1, 2, 3], b=[]))
    assert served(maps) == {fe(1): {be(1), be(2), be(3)}, fe(2): set()}


def test_a_second_sync_of_the_same_state_writes_nothing():
    maps = strict_maps()
    sync(maps, want(a=[1, 2], b=[2, 3]))
    assert sync(maps, want(a=[1, 2], b=[2, 3])) == 0


def test_backends_shared_by_services_are_written_once():
    maps = strict_maps()
    sync(maps, want(a=[1, 2], b=[1, 2]))
    assert len(maps.backends) == 2


def test_scale_down_and_up_keep_every_intermediate_state_consistent():
    maps = strict_maps()  # asserts after every single map operation
    sync(maps, want(a=[1, 2, 3, 4, 5]))
    sync(maps, want(a=[2, 5]))
    assert served(maps) == {fe(1): {be(2), be(5)}}
    sync(maps, want(a=[2, 5, 6, 7, 8, 9]))
    assert served(maps) == {fe(1): {be(2), be(5), be(6), be(7), be(8), be(9)}}


def test_slots_move_between_the_block_and_kpr_slots_as_the_count_crosses_over():
    maps = strict_maps()  # every intermediate state served, as bpf/lb.h reads it
    small, large = list(range(1, 1 + abi.BLOCK_SLOTS)), list(range(1, 2 + abi.BLOCK_SLOTS))
    for backends in (small, large, small[:3], large, []):
        sync(maps, want(a=backends))
        assert served(maps) == {fe(1): {be(b) for b in backends}}
        assert_blocks_match_slots(maps)
        assert len(maps.slots) == (len(backends) if len(backends) > abi.BLOCK_SLOTS else 0)


def test_a_service_id_past_the_slot_block_array_keeps_its_slots_in_kpr_slots():
    maps = MemoryMaps(check=strict_maps().check, block_capacity=2)  # ids 0 and 1
    sync(maps, want(a=[1, 2], b=[3]))
    ids = {f: s.service_id for f, s in maps.read().services.items()}
    assert ids == {fe(1): 1, fe(2): 2}
    assert set(maps.slots) == {(2, 1)} and set(maps.blocks) == {1}
    sync(maps, want(b=[3, 4]))
    assert served(maps) == {fe(2): {be(3), be(4)}}
    assert set(maps.slots) == {(2, 1), (2, 2)}


def test_backend_ids_are_reused_so_they_stay_as_few_as_the_backends():
    # (they index the backend arrays: churn must not walk them past the end)
    maps = strict_maps()
    for generation in range(20):
        sync(maps, want(a=[3 * generation + i for i in (1, 2, 3)]))
    assert set(maps.read().backends) <= set(range(1, 7))  # in use, and freed by the last


def test_removed_service_leaves_no_entries_behind():
    maps = strict_maps()
    sync(maps, want(a=[1, 2], b=[3]))
    sync(maps, want(b=[3]))
    assert served(maps) == {fe(2): {be(3)}}
    assert set(maps.backends.values()) == {be(3)}
    assert len(maps.revnat) == 1
    assert (len(maps.services), len(maps.slots)) == (1, 0)  # b's master (its slot: its block)
    in_use = {sid for sid, block in maps.blocks.items() if any(block)}
    assert in_use == {maps.services[fe(2)].service_id}  # a's block cleared


def test_unchanged_backends_keep_their_slots():
    assert assign_slots([1, 2, 3, 4], [1, 3, 4, 5]) == [1, 5, 3, 4]
    assert assign_slots([1, 2, 3, 4], [1, 4]) == [1, 4]


def test_a_slot_naming_a_backend_twice_behind_kprs_back_is_written_over():
    # (drift: `bpftool map update` made slot 1 name slot 2's backend)
    assert assign_slots([2, 2, 3], [1, 2, 3]) == [2, 1, 3]
    assert assign_slots([2, 2, 2], [2, 3]) == [2, 3]
    assert assign_slots([1, 2], [1, 2, 3]) == [1, 2, 3]


def test_held_frontend_is_left_as_programmed():
    maps = strict_maps()
    sync(maps, want(a=[1, 2], b=[3]))
    translation = want(b=[4])
    translation.held.add(fe(1))
    sync(maps, translation)
    assert served(maps) == {fe(1): {be(1), be(2)}, fe(2): {be(4)}}


def test_adopting_existing_maps_writes_only_the_difference():
    maps = strict_maps()
    sync(maps, want(a=[1, 2, 3], b=[4, 5]))
    steps = plan(maps.read(), want(a=[1, 2, 3], b=[4, 6]))
    assert list(steps.block_writes) == [maps.services[fe(2)].service_id]
    assert not steps.slot_writes and not steps.master_writes
    assert list(steps.backend_writes.values()) == [be(6)]
    assert list(steps.backend_deletes.values()) == [be(5)]


def test_full_map_keeps_the_previous_state_of_the_failing_service():
    maps = MemoryMaps(capacity=6)  # each map
    sync(maps, want(a=[1, 2]))  # 1 master, 2 slots, 2 backends, 1 revnat
    steps = plan(maps.read(), want(a=[1, 2], b=[3, 4, 5, 6, 7]))
    result = execute(maps, steps)
    assert result.failed == {fe(2)}
    assert "map full" in result.errors[0]
    assert served(maps)[fe(1)] == {be(1), be(2)}
    assert fe(2) not in served(maps)


def test_stray_slots_from_an_interrupted_write_are_removed():
    maps = strict_maps()
    sync(maps, want(a=[1, 2]))
    maps.check = None
    sid = maps.services[fe(1)].service_id
    maps.slots[(sid, 1)] = 1  # its slots are in its block (an older kpr wrote both)
    maps.slots[(sid, 7)] = 1  # above the count
    maps.slots[(sid + 5, 1)] = 1  # a service id no master has
    assert maps.read().stray_slots == {(sid, 1), (sid, 7), (sid + 5, 1)}
    sync(maps, want(a=[1, 2]))
    assert not maps.slots
    assert served(maps) == {fe(1): {be(1), be(2)}}


def test_apply_plan_predicts_what_the_maps_hold():
    maps = strict_maps()
    predicted = maps.read()
    for translation in (want(a=[1, 2, 3]), want(a=[3, 4], b=[1]), want(b=[1, 2]), want()):
        steps = plan(predicted, translation)
        execute(maps, steps)
        apply_plan(predicted, steps)
        assert predicted.services == maps.read().services
        assert predicted.backends == maps.read().backends


# (up to 20: across BLOCK_SLOTS, so slots move between the block and kpr_slots)
backend_sets = st.lists(st.integers(min_value=1, max_value=24), max_size=20, unique=True)
states = st.dictionaries(st.sampled_from("abcde"), backend_sets, max_size=5)


@settings(max_examples=150, deadline=None)
@given(st.lists(states, min_size=1, max_size=6))
def test_any_sequence_of_updates_ends_equal_to_the_last_translation(sequence):
    maps = strict_maps()  # no intermediate state has a master count above its slots
    for step in sequence:
        sync(maps, want(**step))
    last = sequence[-1]
    assert served(maps) == {fe(ord(k) - 96): {be(b) for b in v} for k, v in last.items()}
    referenced = {b for s in maps.read().services.values() for b in s.slots}
    assert set(maps.backends) == referenced
    assert_blocks_match_slots(maps)


@pytest.mark.parametrize("protocol", ["TCP", "UDP"])
def test_tcp_and_udp_on_one_port_are_two_frontends(protocol):
    maps = strict_maps()
    translation = Translation(
        {
            fe(1, "TCP"): FrontendState("default/dns:tcp", (be(1),)),
            fe(1, "UDP"): FrontendState("default/dns:udp", (be(2),)),
        }
    )
    sync(maps, translation)
    assert served(maps)[fe(1, protocol)] == {be(1) if protocol == "TCP" else be(2)}


@settings(max_examples=150, deadline=None)
@given(st.lists(states, min_size=2, max_size=6))
def test_plans_for_only_the_changed_frontends_end_in_the_same_maps(sequence):
    maps = strict_maps()
    predicted = maps.read()
    before = Translation()
    for step in sequence:
        after = want(**step)
        touched = {
            f
            for f in before.frontends.keys() | after.frontends.keys()
            if before.frontends.get(f) != after.frontends.get(f)
        }
        steps = plan(predicted, after, touched)
        assert not execute(maps, steps).failed
        apply_plan(predicted, steps)
        counts = [len(s.slots) for s in predicted.services.values()]
        assert predicted.slot_count == sum(n for n in counts if n > abi.BLOCK_SLOTS)
        before = after
    assert served(maps) == {fe(ord(k) - 96): {be(b) for b in v} for k, v in sequence[-1].items()}
    referenced = {b for s in maps.read().services.values() for b in s.slots}
    assert set(maps.backends) == referenced  # no backend leaked by partial plans
    assert len(maps.revnat) == len(sequence[-1])
    assert_blocks_match_slots(maps)


def test_when_the_map_fills_the_services_that_fit_are_written_whole():
    # 30 entries in each map: a needs 17 slot entries, b 20 (more than a block holds);
    # the batch that writes every slot first fills the slot map, and then b's master
    # would count slots not there
    maps = MemoryMaps(capacity=30)
    steps = plan(maps.read(), want(a=list(range(1, 18)), b=list(range(1, 21))))
    result = execute(maps, steps)
    assert result.failed == {fe(2)}
    assert served(maps) == {fe(1): {be(b) for b in range(1, 18)}}
    assert not consistent(maps)
    assert (len(maps.services), len(maps.slots)) == (1, 17)  # b left nothing behind
    assert_blocks_match_slots(maps)  # a's block, written on the one-by-one path


class FullBackends(MemoryMaps):
    """Room for two backends; the service maps have plenty."""

    def write_backends(self, entries):
        result = WriteResult()
        for bid, backend in entries.items():
            if bid not in self.backends and len(self.backends) >= 2:
                result.failed.add(bid)
                result.errors.append("map full")
                continue
            self.backends[bid] = backend
            self._checked()
        return result


def test_a_full_backend_map_fails_the_service_that_does_not_fit_and_no_slot_dangles():
    maps = FullBackends(check=strict_maps().check)  # no slot may name an absent backend
    result = execute(maps, plan(maps.read(), want(a=[1, 2], b=[3, 4])))
    assert result.failed == {fe(2)}
    assert served(maps) == {fe(1): {be(1), be(2)}}
    # and a change that needs one more backend keeps the service as it was
    result = execute(maps, plan(maps.read(), want(a=[1, 5])))
    assert result.failed == {fe(1)}
    assert served(maps) == {fe(1): {be(1), be(2)}}


def ranged(ranges: list[str]) -> Translation:
    out = Translation()
    networks = tuple(ip_network(r) for r in ranges)
    out.frontends[fe(1)] = FrontendState("default/lb", (be(1),), source_ranges=networks)
    return out


def test_source_ranges_change_without_a_moment_of_deny_all_and_leave_nothing_behind():
    maps = strict_maps()  # checks after every single write that a limited master has ranges
    for ranges in (["10.0.0.0/8"], ["10.0.0.0/8", "192.0.2.0/24"], ["192.0.2.0/24"], []):
        sync(maps, ranged(ranges))
        state = maps.read()
        sid = state.services[fe(1)].service_id
        assert state.source_ranges.get(sid, frozenset()) == {ip_network(r) for r in ranges}
        assert bool(state.services[fe(1)].flags) == bool(ranges)
        assert sync(maps, ranged(ranges)) == 0  # and a second sync writes nothing
    sync(maps, Translation())
    assert maps.ranges == {}


def test_a_conflict_found_by_partial_syncs_is_one_problem_however_often_it_repeats():
    from kpr.agent.loop import Agent, AgentConfig
    from kpr.model import Service, ServicePort, Snapshot

    def service(name: str) -> Service:
        port = ServicePort("http", "TCP", 80)
        return Service("default", name, cluster_ips=(ip_address("10.96.0.1"),), ports=(port,))

    agent = Agent(source=None, config=AgentConfig())  # translation only: no maps, no kernel
    agent._translate(Snapshot([service("a")], [], []))
    for _ in range(5):  # "b" keeps changing while "a" holds the address
        agent._translate(Snapshot([service("b")], [], [], changed={("default", "b")}))
    claims = [p for p in agent.desired.problems if "also claimed" in p.message]
    assert len(claims) == 1 and claims[0].ref.name == "b", claims


def test_service_ids_of_deleted_frontends_are_reused_and_a_live_ones_never_changes():
    """Churn through more Services than a service id array holds (the slot blocks are
    indexed by id, 65,536 of them by default): the ids stay as few as the frontends live
    at once, and a frontend that lives through it all keeps its id."""
    from ipaddress import IPv4Address

    maps = MemoryMaps()
    programmed = maps.read()
    steady = Frontend(ip_address("10.96.255.1"), 80, "TCP")
    desired = Translation()
    desired.frontends[steady] = FrontendState("default/steady", (be(1),))
    live: list[Frontend] = []
    created = 0

    def write(touched: set[Frontend]) -> None:
        steps = plan(programmed, desired, touched)
        assert not execute(maps, steps).failed
        apply_plan(programmed, steps)

    write({steady})
    steady_id = programmed.services[steady].service_id
    batch = 500
    while created < 70_000:  # more than the 65,536 ids of the default array
        new = [Frontend(IPv4Address("10.100.0.0") + created + i, 80, "TCP") for i in range(batch)]
        for frontend in new:
            desired.frontends[frontend] = FrontendState("default/churn", (be(2),))
        gone, live = live, new  # the previous batch goes as this one comes
        for frontend in gone:
            del desired.frontends[frontend]
        write(set(new) | set(gone))
        created += batch
        assert programmed.services[steady].service_id == steady_id
    peak = 1 + 2 * batch  # at most this many frontends held ids at once
    ids = [s.service_id for s in programmed.services.values()]
    assert len(set(ids)) == len(ids)  # never two frontends on one id
    assert max(ids) <= peak < 65_536, max(ids)
    # what was planned is what the maps hold, also when read back from scratch
    assert {f: s.service_id for f, s in maps.read().services.items()} == {
        f: s.service_id for f, s in programmed.services.items()
    }
    assert maps.read().free_service_ids == programmed.free_service_ids


def test_a_deleted_frontends_service_id_goes_to_a_later_plans_new_frontend():
    """Slots are keyed by service id: an id freed by a plan is given by a later one only,
    once every entry of its previous frontend is gone (the strict maps check after every
    single operation that no two masters share an id and every counted slot is there)."""
    maps = strict_maps()
    sync(maps, want(a=[1, 2], b=[3]))
    freed = maps.read().services[fe(1)].service_id
    sync(maps, want(b=[3], c=[4]))  # a goes as c comes: c takes a new id
    assert maps.read().services[fe(3)].service_id != freed
    assert maps.read().free_service_ids == [freed]
    sync(maps, want(b=[3], c=[4], d=[5, 6]))  # the next new frontend takes a's
    assert maps.read().services[fe(4)].service_id == freed
    assert served(maps)[fe(4)] == {be(5), be(6)}
    assert_blocks_match_slots(maps)


def test_backend_table_is_a_mapping_by_id() -> None:
    table = BackendTable({3: be(3), 1: be(1)})
    assert len(table) == 2 and list(table) == [1, 3] and table.items() == [(1, be(1)), (3, be(3))]
    assert 1 in table and 2 not in table and 0 not in table and 9 not in table and -1 not in table
    assert table.get(2) is None and table.get(3) == be(3) and table[1] == be(1)
    with pytest.raises(KeyError):
        table[2]
    table[1] = be(5)  # replaced: not counted twice
    assert len(table) == 2 and table.pop(1) == be(5) and table.pop(1, None) is None
    assert table.values() == [be(3)] and table == {3: be(3)} and max(table) == 3
    with pytest.raises(KeyError):
        del table[7]
    with pytest.raises(KeyError):
        table[0] = be(1)  # (ids start at 1)


def be4(n: int) -> Backend:
    return Backend(ip_address(0x0AF40000 + n), 8080)


def be6(n: int) -> Backend:
    return Backend(ip_address(f"fd00::{n:x}"), 80)


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "del"]), st.integers(1, 140), st.integers(0, 60)),
        max_size=60,
    ),
    st.integers(0, 40),
    st.sampled_from([8, 4096]),
)
@example(ops=[("del", 120, 0)], bulk=30, sort_after=8)  # deleted from the sorted copy
@example(ops=[("set", 120, 1)], bulk=30, sort_after=8)  # replaced there
@example(ops=[("set", i, i) for i in range(1, 20)] + [("del", 5, 0)], bulk=0, sort_after=8)
def test_backend_table_finds_each_backend_as_a_dict_would(
    ops: list, bulk: int, sort_after: int
) -> None:
    """Both ways, both families, through its sorted copy, the dict of those added since
    and the entries deleted or replaced since: ids_of answers as a dict backend -> id."""
    with mock.patch.object(plan_module, "SORT_AFTER", sort_after):
        table = BackendTable({i: be4(i) for i in range(100, 100 + bulk)})
        want = {i: be4(i) for i in range(100, 100 + bulk)}
        _apply(table, want, ops)
    assert dict(table.items()) == want and len(table) == len(want) and list(table) == sorted(want)
    probes = [be4(n + 100_000) for n in range(61)] + [be6(n) for n in range(61)]
    probes += [be4(i) for i in range(100, 141)]
    index = {b: bid for bid, b in want.items()}
    assert table.ids_of(probes) == [index.get(b, 0) for b in probes]
    assert table.count_v6() == sum(b.family == 6 for b in want.values())
    # lists of one family and of both (packed as IPv6), with repeats
    lists = [Backends(probes[i::5]) for i in range(5)] + [Backends(probes[60:])]
    lists += [Backends(b for b in probes if b.family == 4)] * 2 + [Backends()]
    lists.append(Backends([be4(99_999), be6(0xFFFF)]))  # (an IPv4 one in no other list)
    new = {b for backends in lists for b in backends} - set(want.values())
    expected = (sum(b.family == 4 for b in new), sum(b.family == 6 for b in new))
    assert table.count_new(lists) == expected
    assert table.count_new([]) == table.count_new([Backends()]) == (0, 0)
    top = max(want, default=0)
    assert table.max_id() == top
    assert table.free_ids(top + 3) == [i for i in range(1, top + 3) if i not in want]


def _apply(table: BackendTable, want: dict[int, Backend], ops: list) -> None:
    for op, bid, n in ops:
        backend = be6(n) if n % 3 == 0 else be4(n + 100_000)
        if op == "set" and backend not in want.values():  # (one id a backend, as kpr gives)
            table[bid] = backend
            want[bid] = backend
        elif op == "del" and bid in want:
            del table[bid]
            del want[bid]


def test_ref_counts_count_each_id_and_forget() -> None:
    refs = RefCounts([1, 4, 4])
    refs.add([4, 9])
    refs.remove([1, 4])
    assert [refs[i] for i in (0, 1, 4, 9, 100)] == [0, 0, 2, 1, 0]
    refs.forget(4)
    assert refs[4] == 0
