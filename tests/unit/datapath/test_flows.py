"""The TC path's UDP flows read from packed kpr_ct entries, and which of them are stale."""

from __future__ import annotations

import socket
from ipaddress import ip_address

from kpr.datapath import abi, flows
from kpr.model import EXTERNAL, Backend, Frontend

CLIENT4, NODE4, POD4 = ip_address("192.0.2.7"), ip_address("198.51.100.1"), ip_address("10.2.0.5")
CLIENT6, NODE6, POD6 = ip_address("2001:db8::7"), ip_address("2001:db8:1::1"), ip_address("fd00::5")
NAT6 = ip_address("2001:db8:1::1")


def a16(address) -> bytes:
    return address.packed.ljust(16, b"\0")


def ct_entry(client, sport, frontend, dport, backend, bport, protocol=socket.IPPROTO_UDP, nat=None):
    family = client.version
    key = abi.FLOW_KEY.pack(a16(client), a16(frontend), sport, dport, protocol, family)
    snat = abi.CT_F_SNAT if nat else 0
    nat_address, nat_port = nat or (None, 0)
    value = abi.CT.pack(
        a16(backend), a16(nat_address) if nat_address else bytes(16), bport, nat_port, 3, 9, snat, 1
    )
    return key, value


def test_udp_flows_are_decoded_with_the_keys_of_both_their_entries():
    v4 = ct_entry(CLIENT4, 40000, NODE4, 30080, POD4, 8080)
    tcp = ct_entry(CLIENT4, 40001, NODE4, 30080, POD4, 8080, protocol=socket.IPPROTO_TCP)
    v6 = ct_entry(CLIENT6, 40002, NODE6, 30080, POD6, 8080, nat=(NAT6, 61234))
    keys = v4[0] + tcp[0] + v6[0]
    values = v4[1] + tcp[1] + v6[1]

    got = list(flows.udp_flows(keys, values))

    assert got == [
        flows.Flow(
            Frontend(NODE4, 30080, "UDP", EXTERNAL),
            Backend(POD4, 8080),
            v4[0],
            # the backend's reply to the client, as the program keys kpr_nat (`reply_key`)
            abi.FLOW_KEY.pack(a16(POD4), a16(CLIENT4), 8080, 40000, socket.IPPROTO_UDP, 4),
        ),
        flows.Flow(
            Frontend(NODE6, 30080, "UDP", EXTERNAL),
            Backend(POD6, 8080),
            v6[0],
            # masqueraded: the reply goes to the node's address and NAT port
            abi.FLOW_KEY.pack(a16(POD6), a16(NAT6), 8080, 61234, socket.IPPROTO_UDP, 6),
        ),
    ]


def test_flows_to_some_frontends_are_picked_out_before_decoding():
    to_a = ct_entry(CLIENT4, 40000, NODE4, 30080, POD4, 8080)
    to_b = ct_entry(CLIENT4, 40000, NODE4, 30081, POD4, 8080)
    to_a6 = ct_entry(CLIENT6, 40000, NODE6, 30080, POD6, 8080)
    keys, values = to_a[0] + to_b[0] + to_a6[0], to_a[1] + to_b[1] + to_a6[1]

    def frontends(*wanted: Frontend) -> list[Frontend]:
        return [f.frontend for f in flows.udp_flows(keys, values, wanted)]

    fe_a, fe_a6 = Frontend(NODE4, 30080, "UDP", EXTERNAL), Frontend(NODE6, 30080, "UDP", EXTERNAL)
    assert frontends(fe_a) == [fe_a]
    assert frontends(fe_a6, Frontend(NODE4, 30082, "UDP", EXTERNAL)) == [fe_a6]
    assert frontends() == []


def test_stale_flows_are_those_whose_backend_no_longer_serves_their_frontend():
    fe_a = Frontend(NODE4, 30080, "UDP", EXTERNAL)
    fe_b = Frontend(NODE4, 30081, "UDP", EXTERNAL)
    fe_gone = Frontend(NODE4, 30082, "UDP", EXTERNAL)
    old, new = Backend(POD4, 8080), Backend(POD4, 9090)

    def flow(frontend, backend, n):
        return flows.Flow(frontend, backend, bytes([n]), bytes([n]))

    to_old, to_new = flow(fe_a, old, 1), flow(fe_a, new, 2)
    other, gone = flow(fe_b, old, 3), flow(fe_gone, new, 4)
    serving = {fe_a: frozenset({new}), fe_b: frozenset()}

    assert flows.stale([to_old, to_new, other, gone], serving) == [to_old, other, gone]
