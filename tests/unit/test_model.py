"""The compact records: a backend packed in an int, a slice's endpoints packed in bytes."""

import pickle
from ipaddress import ip_address

import pytest

from kpr.model import (
    Backend,
    Backends,
    Endpoint,
    Endpoints,
    EndpointSlice,
    FrontendState,
    address_value,
)


def backend(address: str, port: int) -> Backend:
    return Backend(ip_address(address), port)


def test_backend_gives_back_its_address_and_port() -> None:
    for address, port in (("10.244.1.5", 8080), ("fd00:244::5", 53), ("0.0.0.0", 1)):
        b = backend(address, port)
        assert (b.address, b.port, b.family) == (ip_address(address), port, b.address.version)


def test_backends_sort_ipv4_first_then_by_address_then_port() -> None:
    shuffled = [
        backend("fd00::1", 80),
        backend("10.0.0.2", 80),
        backend("255.255.255.255", 65535),
        backend("10.0.0.1", 8080),
        backend("::1", 1),
        backend("10.0.0.1", 80),
    ]
    assert [str(b) for b in sorted(shuffled)] == [
        "10.0.0.1:80",
        "10.0.0.1:8080",
        "10.0.0.2:80",
        "255.255.255.255:65535",
        "[::1]:1",
        "[fd00::1]:80",
    ]


def test_backend_equality_hash_and_pickle_follow_address_and_port() -> None:
    b = backend("fd00::5", 8080)
    assert b == backend("fd00::5", 8080) and hash(b) == hash(backend("fd00::5", 8080))
    assert b != backend("fd00::5", 8081) and b != backend("fd00::6", 8080)
    assert pickle.loads(pickle.dumps(b)) == b and repr(b) == "Backend([fd00::5]:8080)"
    assert b.packed_address == ip_address("fd00::5").packed
    assert Backend.at(address_value(ip_address("fd00::5")), 8080) == b
    assert Backend.count_v6([b, backend("10.0.0.1", 80), backend("::", 1)]) == 2


ENDPOINTS = [
    Endpoint(address_value(ip_address("10.244.1.5"))),
    Endpoint(
        address_value(ip_address("10.244.2.7")),
        ready=False,
        serving=True,
        terminating=True,
        node_name="node-2",
        zone="zone-b",
        hints_for_nodes=("node-2",),
        hints_for_zones=("zone-b", "zone-c"),
    ),
    Endpoint(address_value(ip_address("10.244.1.6")), serving=False, node_name="node-1"),
]


@pytest.mark.parametrize(
    "endpoints",
    [
        ENDPOINTS,
        [
            e._replace(ip=address_value(ip_address(f"fd00:244::{i}")))
            for i, e in enumerate(ENDPOINTS)
        ],
        ENDPOINTS[:1],  # no node, zone or hint: none stored
        [],
    ],
)
def test_packed_endpoints_read_back_as_given(endpoints: list[Endpoint]) -> None:
    packed = Endpoints(endpoints)
    assert list(packed) == endpoints and len(packed) == len(endpoints)
    assert packed == tuple(endpoints) and tuple(endpoints) == packed
    assert [packed[i] for i in range(-len(endpoints), 0)] == endpoints
    assert packed[1:] == tuple(endpoints[1:])
    assert hash(packed) == hash(Endpoints(endpoints))
    with pytest.raises(IndexError):
        packed[len(endpoints)]


def test_a_slice_packs_the_endpoints_it_is_given() -> None:
    endpoint_slice = EndpointSlice("default", "web-1", "web", "IPv4", endpoints=tuple(ENDPOINTS))
    assert isinstance(endpoint_slice.endpoints, Endpoints)
    assert endpoint_slice.endpoints == tuple(ENDPOINTS)
    assert [e.address for e in endpoint_slice.endpoints][0] == ip_address("10.244.1.5")
    assert endpoint_slice.endpoints != tuple(ENDPOINTS[:2])
    assert endpoint_slice.endpoints != Endpoints(e._replace(ready=True) for e in ENDPOINTS)


BACKENDS = [
    Backend(ip_address("10.244.1.5"), 8080),
    Backend(ip_address("10.244.1.6"), 80),
    Backend(ip_address("255.255.255.255"), 65535),
]


@pytest.mark.parametrize(
    "backends",
    [
        BACKENDS,
        [Backend(ip_address(f"fd00:244::{i}"), 8080) for i in range(3)]
        + [Backend(ip_address("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"), 65535)],
        [],
    ],
)
def test_packed_backends_read_back_as_given(backends: list[Backend]) -> None:
    packed = Backends(backends)
    assert (
        list(packed) == backends and len(packed) == len(backends) and bool(packed) == bool(backends)
    )
    assert all(type(b) is Backend for b in packed)  # (with their address and port)
    assert [str(b) for b in packed] == [str(b) for b in backends]
    assert packed.values() == [int(b) for b in backends] and all(
        type(v) is int for v in packed.values()
    )
    assert packed == tuple(backends) and tuple(backends) == packed
    assert (packed != tuple(backends[1:])) == bool(backends)
    assert packed == Backends.of_values([int(b) for b in backends])
    assert hash(packed) == hash(tuple(backends))  # (equal, so hashed alike)
    assert packed[1:] == tuple(backends[1:])
    assert packed.is_v4 == all(b.family == 4 for b in backends)
    assert (packed.packed != b"") == (packed.is_v4 and bool(backends))


def test_a_frontend_state_packs_the_backends_it_is_given() -> None:
    state = FrontendState("default/web:http", tuple(BACKENDS))
    assert isinstance(state.backends, Backends) and state.backends == tuple(BACKENDS)
    assert state == FrontendState("default/web:http", Backends(BACKENDS))
    assert hash(state) == hash(FrontendState("default/web:http", BACKENDS))
