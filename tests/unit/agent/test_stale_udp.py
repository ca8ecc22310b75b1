"""What a sync leaves of UDP traffic to backends that stopped serving: which flows are
forgotten and which sockets terminated, against in-memory maps."""

from __future__ import annotations

from ipaddress import ip_address
from pathlib import Path

from kpr.agent import stale_udp
from kpr.agent.stale_udp import StaleUdp, udp_serving
from kpr.datapath import flows
from kpr.datapath.maps import MemoryMaps, execute
from kpr.datapath.plan import ProgrammedState, apply_plan, plan
from kpr.model import EXTERNAL, SOCKET, Backend, Frontend, FrontendState, Translation

NODE = ip_address("198.51.100.1")


def fe(port: int, scope: int = EXTERNAL, protocol: str = "UDP") -> Frontend:
    return Frontend(NODE, port, protocol, scope)


def be(n: int, port: int = 8080) -> Backend:
    return Backend(ip_address(f"10.2.0.{n}"), port)


class FlowMaps:
    """The flow half of BpfMaps: kpr_ct's UDP flows, and what was deleted."""

    def __init__(self, *table: flows.Flow) -> None:
        self.table = list(table)
        self.reads = 0

    def udp_flows(self, frontends=None):
        self.reads += 1
        return iter([f for f in self.table if frontends is None or f.frontend in frontends])

    def forget_flows(self, stale) -> int:
        stale = list(stale)
        self.table = [f for f in self.table if f not in stale]
        return len(stale)


def flow(frontend: Frontend, backend: Backend) -> flows.Flow:
    key = f"{frontend} {backend}".encode()
    return flows.Flow(frontend, backend, key, key)


class Programmed:
    """The maps as a sequence of syncs leaves them."""

    def __init__(self) -> None:
        self.maps = MemoryMaps()
        self.state = ProgrammedState()

    def sync(self, wanted: dict[Frontend, list[Backend]]) -> ProgrammedState:
        desired = Translation()
        for frontend, backends in wanted.items():
            desired.frontends[frontend] = FrontendState("default/svc:dns", tuple(backends))
        steps = plan(self.state, desired, None)
        execute(self.maps, steps)
        apply_plan(self.state, steps)
        return self.state


def test_the_first_sync_forgets_every_flow_whose_backend_does_not_serve_its_frontend():
    programmed = Programmed().sync({fe(30080): [be(1)], fe(30081): [be(2)]})
    keep, wrong_backend, no_frontend = (
        flow(fe(30080), be(1)),
        flow(fe(30081), be(1)),
        flow(fe(30099), be(1)),
    )
    maps = FlowMaps(keep, wrong_backend, no_frontend)
    udp = StaleUdp(maps, cgroup=None)  # type: ignore[arg-type]

    udp.synced({}, programmed, None)

    assert maps.table == [keep]


def test_later_syncs_read_the_flows_only_when_a_udp_frontend_lost_a_backend():
    lab = Programmed()
    state = lab.sync({fe(30080): [be(1), be(2)], fe(30081): [be(3)]})
    to_1, to_2, to_3 = flow(fe(30080), be(1)), flow(fe(30080), be(2)), flow(fe(30081), be(3))
    maps = FlowMaps(to_1, to_2, to_3)
    udp = StaleUdp(maps, cgroup=None)  # type: ignore[arg-type]
    udp.synced({}, state, None)  # the first: every flow checked
    assert maps.reads == 1

    # a backend added, and a TCP or socket-scope frontend changed: nothing to forget
    before = udp_serving(state, None)
    state = lab.sync(
        {
            fe(30080): [be(1), be(2), be(4)],
            fe(30081): [be(3)],
            fe(30090, protocol="TCP"): [be(5)],
            fe(53, scope=SOCKET): [be(6)],
        }
    )
    udp.synced(before, state, None)
    assert maps.reads == 1

    # a backend replaced, its port changed: the flows to it are forgotten, the rest stay
    before = udp_serving(state, {fe(30080)})
    state = lab.sync({fe(30080): [be(2), be(4)], fe(30081): [be(3)]})
    udp.synced(before, state, {fe(30080)})
    assert maps.reads == 2
    assert maps.table == [to_2, to_3]

    before = udp_serving(state, None)
    state = lab.sync({fe(30080): [be(2), be(4)], fe(30081): [be(3, port=9090)]})
    udp.synced(before, state, None)
    assert maps.table == [to_2]


def test_sockets_are_terminated_to_backends_no_udp_frontend_has_any_more(monkeypatch):
    terminated: list[set[Backend]] = []
    monkeypatch.setattr(
        stale_udp.sockets, "terminate_udp", lambda backends, *_: terminated.append(set(backends))
    )
    lab = Programmed()
    cluster_ip = Frontend(ip_address("10.96.0.10"), 53, "UDP")
    other = Frontend(ip_address("10.96.0.11"), 53, "UDP")
    tcp = Frontend(ip_address("10.96.0.10"), 53, "TCP")
    state = lab.sync({cluster_ip: [be(1), be(2)], other: [be(2)], tcp: [be(3)]})
    udp = StaleUdp(FlowMaps(), cgroup=Path("/sys/fs/cgroup/kpr-test"))  # type: ignore[arg-type]
    udp.synced({}, state, None)

    before = udp_serving(state, {cluster_ip, tcp})
    # be(2) still serves `other`; be(3) was never a UDP backend
    state = lab.sync({cluster_ip: [be(4)], other: [be(2)], tcp: [be(4)]})
    udp.synced(before, state, {cluster_ip, tcp})

    assert terminated == [{be(1)}]
