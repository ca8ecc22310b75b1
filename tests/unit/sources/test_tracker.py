"""The change tracker every source feeds (kpr/sources/tracker.py)."""

from __future__ import annotations

from ipaddress import ip_address

from kpr.model import Endpoint, EndpointSlice, ObjectRef, Service, address_value
from kpr.sources.tracker import Changes, ChangeTracker


def svc(name: str, namespace: str = "default") -> Service:
    return Service(namespace, name)


def eps(name: str, service: str | None, namespace: str = "default", n: int = 1) -> EndpointSlice:
    endpoints = tuple(Endpoint(address_value(ip_address(f"10.0.0.{i + 1}"))) for i in range(n))
    return EndpointSlice(namespace, name, service, "IPv4", endpoints=endpoints)


def names(changes: Changes | None) -> tuple[list[str], list[str], set | None]:
    assert changes is not None
    return (
        sorted(s.name for s in changes.services),
        sorted(s.name for s in changes.slices),
        changes.changed,
    )


def primed(*objects: Service | EndpointSlice) -> ChangeTracker:
    """A tracker holding these objects, its first (whole) state already taken."""
    tracker = ChangeTracker()
    for obj in objects:
        tracker.upsert(obj)
    assert tracker.take() is not None
    return tracker


def test_the_first_take_is_the_whole_state_and_then_nothing_until_a_change() -> None:
    tracker = ChangeTracker()
    tracker.upsert(svc("web"))
    tracker.upsert(eps("web-1", "web"))
    assert names(tracker.take()) == (["web"], ["web-1"], None)
    assert tracker.take() is None


def test_a_slice_change_hands_over_its_service_with_all_of_its_slices() -> None:
    tracker = primed(svc("web"), eps("web-1", "web"), eps("web-2", "web"), svc("db"))
    tracker.upsert(eps("web-2", "web", n=3))
    assert names(tracker.take()) == (["web"], ["web-1", "web-2"], {("default", "web")})
    assert tracker.take() is None


def test_changes_between_takes_are_coalesced_per_service() -> None:
    tracker = primed(svc("web"), svc("db"), svc("api"))
    tracker.upsert(svc("web"))
    tracker.upsert(eps("web-1", "web"))
    tracker.upsert(eps("db-1", "db"))
    assert tracker.pending() == 2
    assert names(tracker.take()) == (
        ["db", "web"],
        ["db-1", "web-1"],
        {("default", "web"), ("default", "db")},
    )
    assert tracker.pending() == 0


def test_a_deleted_service_is_named_as_changed_and_handed_over_without_it() -> None:
    tracker = primed(svc("web"), eps("web-1", "web"))
    tracker.delete(ObjectRef("Service", "default", "web"))
    assert names(tracker.take()) == ([], ["web-1"], {("default", "web")})


def test_a_slice_moved_to_another_service_changes_both() -> None:
    tracker = primed(svc("web"), svc("db"), eps("x", "web"))
    tracker.upsert(eps("x", "db"))
    assert names(tracker.take()) == (["db", "web"], ["x"], {("default", "web"), ("default", "db")})
    tracker.upsert(svc("web"))
    assert names(tracker.take()) == (["web"], [], {("default", "web")})  # no longer its slice


def test_deleting_what_is_not_there_changes_nothing() -> None:
    tracker = primed(svc("web"))
    tracker.delete(ObjectRef("Service", "default", "gone"))
    assert tracker.take() is None


def test_a_slice_of_no_service_changes_no_service() -> None:
    tracker = primed()
    tracker.upsert(eps("orphan", None))
    assert tracker.take() is None


def test_a_list_replaces_its_table_and_makes_the_next_take_whole() -> None:
    tracker = primed(svc("web"), svc("db"))
    tracker.replace("", {svc("api").ref: svc("api"), svc("db").ref: svc("db")})
    assert names(tracker.take()) == (["api", "db"], [], None)


def test_a_list_of_slices_keeps_the_index_to_their_services() -> None:
    tracker = ChangeTracker()
    tracker.replace("services", {svc("web").ref: svc("web")})
    tracker.replace("slices", {eps("web-1", "web").ref: eps("web-1", "web")})
    tracker.take()
    tracker.replace("slices", {eps("web-2", "web").ref: eps("web-2", "web")})
    tracker.take()
    tracker.upsert(svc("web"), "services")
    assert names(tracker.take()) == (["web"], ["web-2"], {("default", "web")})


def test_an_object_in_two_tables_is_handed_over_once() -> None:
    """A Service relabelled from one watch's selector to the other's: added to the second
    before the first deletes it."""
    tracker = ChangeTracker()
    tracker.upsert(svc("web"), "services-0")
    tracker.upsert(svc("web"), "services-1")
    tracker.upsert(eps("web-1", "web"), "slices-0")
    assert names(tracker.take()) == (["web"], ["web-1"], None)
    tracker.upsert(eps("web-1", "web"), "slices-1")
    assert names(tracker.take()) == (["web"], ["web-1"], {("default", "web")})
    tracker.delete(svc("web").ref, "services-0")
    assert names(tracker.take()) == (["web"], ["web-1"], {("default", "web")})


def test_resync_makes_the_next_take_whole() -> None:
    tracker = primed(svc("web"))
    tracker.resync()
    assert names(tracker.take()) == (["web"], [], None)
