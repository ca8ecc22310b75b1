"""Drift, measured once for the agent and for `kpr status` (kpr/desired/drift.py)."""

from __future__ import annotations

from ipaddress import ip_address

from kpr.cli.status import drift as status_drift
from kpr.datapath.maps import MemoryMaps, execute
from kpr.datapath.plan import plan
from kpr.desired.drift import Entry, drift, entries
from kpr.model import Backend, Frontend, FrontendState, Translation


def fe(n: int) -> Frontend:
    return Frontend(ip_address(f"10.96.0.{n}"), 80, "TCP")


def be(n: int) -> Backend:
    return Backend(ip_address(f"10.244.0.{n}"), 8080)


def test_equal_entries_in_any_backend_order_are_no_drift() -> None:
    wanted = {fe(1): Entry((be(1), be(2)), 7)}
    assert drift(wanted, {fe(1): Entry((be(2), be(1)), 7)}) == []


def test_each_kind_of_difference_is_named_with_its_frontend_and_service() -> None:
    wanted = {
        "10.96.0.1:80/TCP": Entry(("10.244.0.1:8080",), service="default/web:http"),
        "10.96.0.2:80/TCP": Entry(("10.244.0.1:8080", "10.244.0.2:8080"), service="default/db"),
        "10.96.0.3:80/TCP": Entry((), service="default/held"),
    }
    have = {
        "10.96.0.2:80/TCP": Entry(("10.244.0.1:8080", "10.244.0.9:8080")),
        "10.96.0.4:80/TCP": Entry(("10.244.0.1:8080",)),
        "10.96.0.5:80/TCP": Entry(()),
        "10.96.0.3:80/TCP": Entry(()),
    }
    assert [str(d) for d in drift(wanted, have, held=["10.96.0.5:80/TCP"])] == [
        "10.96.0.1:80/TCP (default/web:http): missing from the maps",
        "10.96.0.2:80/TCP (default/db): maps hold 2 backends ['10.244.0.9:8080'] extra, "
        "['10.244.0.2:8080'] missing",
        "10.96.0.4:80/TCP: in the maps but not wanted",  # (.5 is held: it may stay)
    ]


def test_a_service_id_changed_behind_the_agents_back_is_drift_when_known() -> None:
    wanted = {fe(1): Entry((be(1),), service_id=3)}
    (found,) = drift(wanted, {fe(1): Entry((be(1),), service_id=4)})
    assert str(found) == "10.96.0.1:80/TCP: service id 4 in the maps, 3 written"
    assert drift({fe(1): Entry((be(1),))}, {fe(1): Entry((be(1),), service_id=4)}) == []


def test_the_agent_counts_what_was_changed_in_the_maps_since_it_wrote_them() -> None:
    maps = MemoryMaps()
    desired = Translation()
    for n in (1, 2, 3):
        desired.frontends[fe(n)] = FrontendState(f"default/s{n}", (be(n), be(n + 1)))
    assert not execute(maps, plan(maps.read(), desired)).failed
    written = maps.read()
    assert drift(entries(written), entries(maps.read())) == []
    # behind its back: one backend's address rewritten, one frontend's entries deleted
    backend_id = next(i for i, b in maps.backends.items() if b == be(1))
    maps.backends[backend_id] = be(9)
    gone = maps.services.pop(fe(3))  # its master, then its slots (service id, slot)
    for key in [k for k in maps.slots if k[0] == gone.service_id]:
        del maps.slots[key]
    found = drift(entries(written), entries(maps.read()))
    assert [d.frontend for d in found] == ["10.96.0.1:80/TCP", "10.96.0.3:80/TCP"]


def test_status_reports_drift_with_the_same_function_on_the_run_state_strings() -> None:
    desired = {"10.96.0.1:80/TCP": {"service": "default/web", "backends": ["10.244.0.1:8080"]}}
    programmed = {"10.96.0.1:80/TCP": [], "10.96.0.2:80/TCP": ["10.244.0.1:8080"]}
    assert status_drift(desired, [], programmed) == [
        "10.96.0.1:80/TCP (default/web): maps hold 0 backends [] extra, "
        "['10.244.0.1:8080'] missing",
        "10.96.0.2:80/TCP: in the maps but not wanted",
    ]
    assert status_drift(desired, [], {"10.96.0.1:80/TCP": ["10.244.0.1:8080"]}) == []
