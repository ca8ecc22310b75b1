"""bpf/nodeport.c packet by packet: crafted frames through BPF_PROG_TEST_RUN in a
throwaway network namespace (tests/support/tc_harness.py), checked with scapy and with
the checksums a receiver computes.

Return values: TC_ACT_UNSPEC (-1) is "not translated or translated for the kernel
to deliver" (kpr's filter lets the next one run), TC_ACT_SHOT a drop,
TC_ACT_REDIRECT a packet kpr sent on itself (masqueraded flows, ICMP replies).
"""

from __future__ import annotations

import ctypes as ct
import errno
import ipaddress
import os
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kpr.datapath import abi, bpfsys, tc
from kpr.node import host
from kpr.node.devices import read_devices
from tests.support import tc_harness as h
from tests.support.tc_harness import Frontend, flow_key

try:
    from scapy.all import (
        ARP,
        ICMP,
        IP,
        TCP,
        UDP,
        Dot1Q,
        Ether,
        ICMPv6DestUnreach,
        ICMPv6EchoRequest,
        IPOption_NOP,
        IPOption_RR,
        IPv6,
        IPv6ExtHdrHopByHop,
    )
except ImportError:
    pytest.skip("needs scapy (the test extra: pip install -e '.[test]')", allow_module_level=True)

TCP_P, UDP_P = 6, 17
PASS, SHOT, REDIRECT = h.TC_ACT_UNSPEC, h.TC_ACT_SHOT, h.TC_ACT_REDIRECT

FAMILIES = {
    4: dict(
        node=h.NODE4,
        client=h.CLIENT4,
        local=h.LOCAL_POD4,
        remote=h.REMOTE_POD4,
        lb="192.0.2.100",  # a LoadBalancer / external IP routed to the node
        other_client="203.0.113.7",
    ),
    6: dict(
        node=h.NODE6,
        client=h.CLIENT6,
        local=h.LOCAL_POD6,
        remote=h.REMOTE_POD6,
        lb="2001:db8:1::100",
        other_client="2001:db8:d::7",
    ),
}
MATRIX = [(4, TCP_P), (4, UDP_P), (6, TCP_P), (6, UDP_P)]
IDS = ["ipv4-tcp", "ipv4-udp", "ipv6-tcp", "ipv6-udp"]


@pytest.fixture(scope="module")
def lab():
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    lab = h.Lab()
    try:
        lab.start()
        yield lab
    finally:
        lab.close()


@pytest.fixture(autouse=True)
def fresh(request):
    if "lab" in request.fixturenames:
        request.getfixturevalue("lab").reset()


def frame(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    protocol: int,
    payload: bytes = b"kpr says hello",
    flags: str = "S",
    src_mac: str = h.GW_MAC,
    dst_mac: str = h.NODE_MAC,
    ip_options=None,
    udp_checksum: int | None = None,
) -> bytes:
    if ipaddress.ip_address(src).version == 4:
        ip = IP(src=src, dst=dst, options=ip_options or [])
    else:
        ip = IPv6(src=src, dst=dst)
    if protocol == TCP_P:
        l4 = TCP(sport=sport, dport=dport, flags=flags, seq=1000)
    else:
        l4 = (
            UDP(sport=sport, dport=dport)
            if udp_checksum is None
            else UDP(sport=sport, dport=dport, chksum=udp_checksum)
        )
    return bytes(Ether(src=src_mac, dst=dst_mac) / ip / l4 / payload)


def ip_layer(packet):
    return packet[IP] if IP in packet else packet[IPv6]


def l4_layer(packet):
    return packet[TCP] if TCP in packet else packet[UDP]


def assert_tuple(data: bytes, src: str, sport: int, dst: str, dport: int) -> None:
    packet = Ether(data)
    ip, l4 = ip_layer(packet), l4_layer(packet)
    assert (ip.src, l4.sport, ip.dst, l4.dport) == (src, sport, dst, dport)
    assert h.checksums_valid(data), packet.show2(dump=True)


def same_payload(a: bytes, b: bytes) -> bool:
    return bytes(l4_layer(Ether(a)).payload) == bytes(l4_layer(Ether(b)).payload)


# --- translation: a local backend keeps the client address ---


@pytest.mark.parametrize("version,protocol", MATRIX, ids=IDS)
def test_new_flow_to_a_local_backend_is_rewritten_and_its_reply_restored(lab, version, protocol):
    a = FAMILIES[version]
    fe = Frontend(a["node"], 30080, protocol)
    lab.add_service(fe, [(a["local"], 8080)])

    first = frame(a["client"], a["node"], 40000, 30080, protocol)
    result = lab.ingress(first)
    assert result.retval == PASS  # the kernel forwards it to the pod
    assert_tuple(result.data, a["client"], 40000, a["local"], 8080)
    assert len(result.data) == len(first) and same_payload(result.data, first)
    assert lab.stat("external_translated") == 1

    entry = lab.get("kpr_ct", flow_key(a["client"], a["node"], 40000, 30080, protocol), abi.Ct)
    assert bytes(entry.backend_address) == h.addr16(a["local"])
    assert (entry.backend_port, entry.flags) == (8080, 0)
    nat = lab.get("kpr_nat", flow_key(a["local"], a["client"], 8080, 40000, protocol), abi.Nat)
    assert bytes(nat.frontend_address) == h.addr16(a["node"])
    assert bytes(nat.client_address) == h.addr16(a["client"])
    assert (nat.frontend_port, nat.client_port, nat.flags) == (30080, 40000, 0)

    second = lab.ingress(frame(a["client"], a["node"], 40000, 30080, protocol, flags="A"))
    assert second.retval == PASS
    assert_tuple(second.data, a["client"], 40000, a["local"], 8080)
    assert lab.stat("external_translated") == 1  # a known flow, not a new one

    reply = frame(
        a["local"],
        a["client"],
        8080,
        40000,
        protocol,
        flags="SA",
        src_mac=h.NODE_MAC,
        dst_mac=h.GW_MAC,
    )
    back = lab.egress(reply)
    assert back.retval == PASS
    assert_tuple(back.data, a["node"], 30080, a["client"], 40000)
    assert same_payload(back.data, reply)


@pytest.mark.parametrize("version,protocol", MATRIX, ids=IDS)
def test_flow_to_a_remote_backend_is_masqueraded_and_its_reply_sent_to_the_client(
    lab, version, protocol
):
    a = FAMILIES[version]
    fe = Frontend(a["lb"], 80, protocol)
    lab.add_service(fe, [(a["remote"], 8080)])

    result = lab.ingress(frame(a["client"], a["lb"], 40000, 80, protocol))
    assert result.retval == REDIRECT  # sent on by kpr: its source is a local address now
    out = Ether(result.data)
    nat_port = l4_layer(out).sport
    assert 61000 <= nat_port <= 65535
    assert_tuple(result.data, a["node"], nat_port, a["remote"], 8080)
    assert (out.src, out.dst) == (h.NODE_MAC, h.OTHER_NODE_MAC)  # to the other node

    entry = lab.get("kpr_ct", flow_key(a["client"], a["lb"], 40000, 80, protocol), abi.Ct)
    assert entry.flags == abi.CT_F_SNAT
    assert (bytes(entry.nat_address), entry.nat_port) == (h.addr16(a["node"]), nat_port)
    nat = lab.get("kpr_nat", flow_key(a["remote"], a["node"], 8080, nat_port, protocol), abi.Nat)
    assert nat.flags == abi.CT_F_SNAT and nat.client_port == 40000

    again = lab.ingress(frame(a["client"], a["lb"], 40000, 80, protocol, flags="A"))
    assert again.retval == REDIRECT
    assert_tuple(again.data, a["node"], nat_port, a["remote"], 8080)

    reply = frame(
        a["remote"], a["node"], 8080, nat_port, protocol, flags="SA", src_mac=h.OTHER_NODE_MAC
    )
    back = lab.ingress(reply)
    assert back.retval == REDIRECT
    assert_tuple(back.data, a["lb"], 80, a["client"], 40000)
    assert same_payload(back.data, reply)
    assert (Ether(back.data).src, Ether(back.data).dst) == (h.NODE_MAC, h.GW_MAC)
    # the egress program leaves masqueraded replies to ingress
    assert lab.egress(reply).data == reply


def test_reply_to_a_client_whose_neighbour_is_unknown_goes_through_redirect_neigh(lab):
    a = FAMILIES[4]
    lab.add_service(Frontend(a["node"], 30080, TCP_P), [(a["remote"], 8080)])
    out = lab.ingress(frame(h.CLIENT4_NO_NEIGH, a["node"], 40000, 30080, TCP_P))
    assert out.retval == REDIRECT
    nat_port = Ether(out.data)[TCP].sport
    reply = frame(a["remote"], a["node"], 8080, nat_port, TCP_P, flags="SA")
    back = lab.ingress(reply)
    assert back.retval == REDIRECT
    assert_tuple(back.data, a["node"], 30080, h.CLIENT4_NO_NEIGH, 40000)
    assert back.data[:12] == reply[:12]  # MACs untouched: the kernel resolves the next hop


def test_device_without_an_address_of_the_family_does_not_masquerade(lab):
    a = FAMILIES[6]
    lab.set_devices({"ext0": (h.NODE4, None)})
    lab.add_service(Frontend(a["node"], 30080, TCP_P), [(a["remote"], 8080)])
    result = lab.ingress(frame(a["client"], a["node"], 40000, 30080, TCP_P))
    assert result.retval == PASS
    assert_tuple(result.data, a["client"], 40000, a["remote"], 8080)


# --- the egress device: masquerade whatever device the route to the backend leaves by ---

SECOND_NIC = {4: (h.EXT1_4, h.SECOND_NIC_POD4), 6: (h.EXT1_6, h.SECOND_NIC_POD6)}
BARE = {4: h.BARE_POD4, 6: h.BARE_POD6}


def node_and_second_nic(lab) -> None:
    """As the agent writes kpr_devices: the --devices device (ext0), the node's address,
    and ext1, a device kpr is on for the replies only (a second NIC, an overlay)."""
    lab.set_devices(
        {
            "ext0": (h.NODE4, h.NODE6),
            "node": (h.NODE4, h.NODE6),
            "ext1": (h.EXT1_4, h.EXT1_6, abi.DEVICE_F_REPLIES),
        }
    )


@pytest.mark.parametrize("version,protocol", MATRIX, ids=IDS)
def test_flow_to_a_backend_behind_another_device_is_masqueraded_to_that_devices_address(
    lab, version, protocol
):
    a = FAMILIES[version]
    device_address, pod = SECOND_NIC[version]
    node_and_second_nic(lab)
    lab.add_service(Frontend(a["node"], 30080, protocol), [(pod, 8080)])

    out = lab.ingress(frame(a["client"], a["node"], 40000, 30080, protocol))
    assert out.retval == REDIRECT
    nat_port = l4_layer(Ether(out.data)).sport
    assert_tuple(out.data, device_address, nat_port, pod, 8080)  # as MASQUERADE picks it
    assert (Ether(out.data).src, Ether(out.data).dst) == (h.NODE_MAC, h.PEER_MAC)

    # the reply comes back on ext1, to ext1's address: to the client from the NodePort
    reply = frame(pod, device_address, 8080, nat_port, protocol, flags="SA", src_mac=h.PEER_MAC)
    back = lab.ingress(reply, device="ext1")
    assert back.retval == REDIRECT
    assert_tuple(back.data, a["node"], 30080, a["client"], 40000)
    assert (Ether(back.data).src, Ether(back.data).dst) == (h.NODE_MAC, h.GW_MAC)


@pytest.mark.parametrize("version", [4, 6])
def test_a_backend_behind_a_device_without_an_address_is_masqueraded_to_the_node_address(
    lab, version
):
    a = FAMILIES[version]
    node_and_second_nic(lab)  # bare0 has no entry: it has no address
    lab.add_service(Frontend(a["node"], 30080, TCP_P), [(BARE[version], 8080)])
    out = lab.ingress(frame(a["client"], a["node"], 40000, 30080, TCP_P))
    assert out.retval == REDIRECT
    assert_tuple(out.data, a["node"], Ether(out.data)[TCP].sport, BARE[version], 8080)


def test_a_local_backend_keeps_the_client_address_whatever_its_route(lab):
    a = FAMILIES[4]
    node_and_second_nic(lab)
    lab.add_service(Frontend(a["node"], 30080, TCP_P), [(a["local"], 8080)])
    lab.set_devices(
        {"ext0": (h.NODE4, h.NODE6), "node": (h.NODE4, h.NODE6), "pod0": ("10.244.0.1", None, 1)}
    )  # even when the agent is on its device too (a bridge with an address)
    out = lab.ingress(frame(a["client"], a["node"], 40000, 30080, TCP_P))
    assert out.retval == PASS
    assert_tuple(out.data, a["client"], 40000, a["local"], 8080)


def test_a_replies_only_device_serves_no_frontend(lab):
    a = FAMILIES[4]
    node_and_second_nic(lab)
    lab.add_service(Frontend(a["node"], 30080, TCP_P), [(a["local"], 8080)])
    packet = frame(a["client"], a["node"], 40000, 30080, TCP_P)
    untouched = lab.ingress(packet, device="ext1")
    assert (untouched.retval, untouched.data) == (PASS, packet)
    assert lab.stat("external_translated") == 0
    assert lab.ingress(packet).retval == PASS and lab.stat("external_translated") == 1


@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
def test_udp_over_ipv4_without_checksum_keeps_none(lab, local):
    a = FAMILIES[4]
    backend = a["local"] if local else a["remote"]
    lab.add_service(Frontend(a["node"], 30053, UDP_P), [(backend, 53)])
    result = lab.ingress(frame(a["client"], a["node"], 40000, 30053, UDP_P, udp_checksum=0))
    assert result.retval == (PASS if local else REDIRECT)
    assert Ether(result.data)[UDP].chksum == 0
    assert Ether(result.data)[IP].dst == backend
    assert h.checksums_valid(result.data)


def test_ethernet_padding_is_kept_and_left_out_of_the_checksum(lab):
    a = FAMILIES[4]
    lab.add_service(Frontend(a["node"], 30053, UDP_P), [(a["local"], 53)])
    original = frame(a["client"], a["node"], 40000, 30053, UDP_P, payload=b"x")
    padded = original + b"\xee" * 18
    result = lab.ingress(padded)
    assert result.retval == PASS and len(result.data) == len(padded)
    assert result.data.endswith(b"\xee" * 18)
    assert_tuple(result.data, a["client"], 40000, a["local"], 53)


@pytest.mark.parametrize("protocol", [TCP_P, UDP_P], ids=["tcp", "udp"])
def test_ipv4_with_options_is_translated(lab, protocol):
    a = FAMILIES[4]
    lab.add_service(Frontend(a["node"], 30080, protocol), [(a["local"], 8080)])
    options = [IPOption_NOP(), IPOption_RR(routers=["1.2.3.4", "5.6.7.8"])]
    original = frame(a["client"], a["node"], 40000, 30080, protocol, ip_options=options)
    assert Ether(original)[IP].ihl > 5
    result = lab.ingress(original)
    assert result.retval == PASS
    assert_tuple(result.data, a["client"], 40000, a["local"], 8080)
    ihl = Ether(original)[IP].ihl * 4
    assert result.data[14 + 20 : 14 + ihl] == original[14 + 20 : 14 + ihl]  # options kept
    assert same_payload(result.data, original)

    reply = frame(a["local"], a["client"], 8080, 40000, protocol, flags="SA", ip_options=options)
    back = lab.egress(reply)
    assert_tuple(back.data, a["node"], 30080, a["client"], 40000)


# --- what is not kpr's passes untouched ---


def untouched(lab, data: bytes, direction: str = "ingress") -> None:
    result = lab.run(direction, data)
    assert result.retval == PASS
    assert result.data == data


def test_traffic_to_no_frontend_is_untouched(lab):
    for version in (4, 6):
        a = FAMILIES[version]
        lab.add_service(Frontend(a["node"], 30080, TCP_P), [(a["local"], 8080)])
        lab.add_service(Frontend(a["node"], 30053, UDP_P), [(a["local"], 53)])
    for version, protocol in MATRIX:
        a = FAMILIES[version]
        for data in (
            frame(a["client"], a["node"], 40000, 22, protocol),  # another port
            frame(a["client"], a["lb"], 40000, 30080, protocol),  # another address
            frame(a["node"], a["client"], 30080, 40000, protocol),  # the node's own traffic
        ):
            untouched(lab, data)
            untouched(lab, data, "egress")
        # the port of a frontend of the other protocol: another frontend
        other_port = 30080 if protocol == UDP_P else 30053
        untouched(lab, frame(a["client"], a["node"], 40000, other_port, protocol))
    assert lab.entries("kpr_ct", abi.FlowKey, abi.Ct) == []


def test_socket_scope_frontends_are_not_served_by_tc(lab):
    for version, protocol in MATRIX:
        a = FAMILIES[version]
        fe = Frontend(a["lb"], 80, protocol)
        lab.add_service(fe, [(a["local"], 8080)], scope=h.SCOPE_SOCKET)
        untouched(lab, frame(a["client"], a["lb"], 40000, 80, protocol))
        lab.add_service(Frontend(a["lb"], 81, protocol), [], scope=h.SCOPE_SOCKET)
        untouched(lab, frame(a["client"], a["lb"], 40000, 81, protocol))  # no ICMP either


def test_icmp_arp_and_ipv6_extension_headers_are_untouched(lab):
    lab.add_service(Frontend(h.NODE4, 30080, TCP_P), [(h.LOCAL_POD4, 8080)])
    lab.add_service(Frontend(h.NODE6, 30080, TCP_P), [(h.LOCAL_POD6, 8080)])
    eth = Ether(src=h.GW_MAC, dst=h.NODE_MAC)
    for packet in (
        Ether(src=h.GW_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(psrc=h.CLIENT4, pdst=h.NODE4),
        eth / IP(src=h.CLIENT4, dst=h.NODE4) / ICMP(),
        eth / IP(src=h.CLIENT4, dst=h.NODE4, proto=132) / (b"\0" * 40),  # SCTP
        eth / IPv6(src=h.CLIENT6, dst=h.NODE6) / ICMPv6EchoRequest(),
        eth / IPv6(src=h.CLIENT6, dst=h.NODE6) / IPv6ExtHdrHopByHop() / TCP(dport=30080),
        eth / Dot1Q(vlan=5) / IP(src=h.CLIENT4, dst=h.NODE4) / TCP(dport=30080),  # tagged
    ):
        untouched(lab, bytes(packet))
        untouched(lab, bytes(packet), "egress")


def test_ipv4_fragments_are_untouched(lab):
    lab.add_service(Frontend(h.NODE4, 30053, UDP_P), [(h.LOCAL_POD4, 53)])
    eth = Ether(src=h.GW_MAC, dst=h.NODE_MAC)
    datagram = IP(src=h.CLIENT4, dst=h.NODE4, id=7) / UDP(sport=40000, dport=30053) / (b"z" * 64)
    raw = bytes(datagram)
    first = IP(raw)
    first.flags = "MF"
    first.len = None
    first.chksum = None
    first_bytes = bytes(eth / IP(bytes(first)[:20] + raw[20 : 20 + 32]))
    later = eth / IP(src=h.CLIENT4, dst=h.NODE4, id=7, frag=4, proto=17) / raw[20 + 32 :]
    # a later fragment whose first bytes happen to look like the service's ports
    later_lookalike = eth / IP(src=h.CLIENT4, dst=h.NODE4, id=7, frag=4, proto=17) / raw[20:]
    for data in (first_bytes, bytes(later), bytes(later_lookalike)):
        untouched(lab, data)
    assert lab.entries("kpr_ct", abi.FlowKey, abi.Ct) == []


def kernel_refuses(data: bytes) -> bool:
    """BPF_PROG_TEST_RUN refuses (EINVAL) a frame shorter than Ethernet, or than
    Ethernet + the IPv4/IPv6 header its ethertype announces (this kernel checks)."""
    if len(data) < 14:
        return True
    ethertype = int.from_bytes(data[12:14], "big")
    return (ethertype == 0x0800 and len(data) < 14 + 20) or (
        ethertype == 0x86DD and len(data) < 14 + 40
    )


def run(lab, direction: str, data: bytes) -> bpfsys.ProgRun | None:
    """A test run, or None where the kernel refuses to build the skb at all."""
    try:
        return lab.run(direction, data)
    except OSError as err:
        if err.errno == errno.EINVAL and kernel_refuses(data):
            return None
        raise


@pytest.mark.parametrize("version,protocol", MATRIX, ids=IDS)
def test_every_truncation_of_a_service_packet_is_untouched(lab, version, protocol):
    a = FAMILIES[version]
    lab.add_service(Frontend(a["node"], 30080, protocol), [(a["local"], 8080)])
    whole = frame(a["client"], a["node"], 40000, 30080, protocol)
    ran = 0
    for length in range(0, len(whole)):
        prefix = whole[:length]
        for direction in ("ingress", "egress"):
            result = run(lab, direction, prefix)
            if result is None:
                continue
            ran += 1
            assert result.retval == PASS, length
            assert result.data == prefix, length
    assert ran >= 2 * 20  # every prefix that holds the IP header, at least
    assert lab.ingress(whole).retval == PASS  # and the whole one is translated
    assert lab.entries("kpr_ct", abi.FlowKey, abi.Ct) != []


def _set_u8(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1 :]


def _set_u16(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + value.to_bytes(2, "big") + data[offset + 2 :]


def test_malformed_headers_are_untouched(lab):
    a4, a6 = FAMILIES[4], FAMILIES[6]
    lab.add_service(Frontend(a4["node"], 30080, TCP_P), [(a4["local"], 8080)])
    lab.add_service(Frontend(a4["node"], 30053, UDP_P), [(a4["local"], 53)])
    lab.add_service(Frontend(a6["node"], 30080, TCP_P), [(a6["local"], 8080)])
    tcp4 = frame(a4["client"], a4["node"], 40000, 30080, TCP_P)
    udp4 = frame(a4["client"], a4["node"], 40000, 30053, UDP_P, payload=b"")
    tcp6 = frame(a6["client"], a6["node"], 40000, 30080, TCP_P)
    cases = {
        "ihl 0": _set_u8(tcp4, 14, 0x40),
        "ihl 4": _set_u8(tcp4, 14, 0x44),
        "ihl beyond the packet": _set_u8(tcp4, 14, 0x4F),
        "version 6 in an IPv4 frame": _set_u8(tcp4, 14, 0x65),
        "total length < header": _set_u16(tcp4, 16, 19),
        "total length without the TCP header": _set_u16(tcp4, 16, 20 + 19),
        "total length without the UDP header": _set_u16(udp4, 16, 20 + 7),
        "total length beyond the frame": _set_u16(tcp4, 16, len(tcp4) - 14 + 1),
        "IPv6 payload length without the TCP header": _set_u16(tcp6, 18, 19),
        "IPv6 payload length beyond the frame": _set_u16(tcp6, 18, len(tcp6) - 54 + 1),
        "version 4 in an IPv6 frame": _set_u8(tcp6, 14, 0x40),
    }
    for name, data in cases.items():
        for direction in ("ingress", "egress"):
            result = lab.run(direction, data)
            assert result.retval in (PASS, SHOT), name
            assert result.retval == SHOT or result.data == data, name


# --- no endpoints: ICMP port unreachable ---


@pytest.mark.parametrize("version,protocol", MATRIX, ids=IDS)
def test_frontend_without_endpoints_answers_port_unreachable(lab, version, protocol):
    a = FAMILIES[version]
    lab.add_service(Frontend(a["lb"], 80, protocol), [])
    original = frame(a["client"], a["lb"], 40000, 80, protocol)
    result = lab.ingress(original)
    assert result.retval == REDIRECT  # back out of the device it came in on
    assert lab.stat("external_rejected") == 1
    reply = Ether(result.data)
    assert (reply.src, reply.dst) == (h.NODE_MAC, h.GW_MAC)  # MACs swapped
    ip = ip_layer(reply)
    assert (ip.src, ip.dst) == (a["lb"], a["client"])
    assert h.checksums_valid(result.data)
    if version == 4:
        assert (ip.ttl, ip.proto, reply[ICMP].type, reply[ICMP].code) == (64, 1, 3, 3)
        assert ip.len == len(result.data) - 14
        quote = bytes(reply[ICMP].payload)
        assert quote == original[14 : 14 + 20 + 8]
    else:
        assert (ip.hlim, ip.nh) == (64, 58)
        assert reply[ICMPv6DestUnreach].code == 4
        assert ip.plen == len(result.data) - 54
        quote = result.data[14 + 40 + 8 :]
        assert quote == original[14 : 14 + 40 + 8]
    assert lab.entries("kpr_ct", abi.FlowKey, abi.Ct) == []


def test_external_traffic_policy_local_without_local_endpoints_drops(lab):
    lab.add_service(Frontend(h.NODE4, 30080, TCP_P), [], flags=abi.SVC_F_DROP)
    assert lab.ingress(frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P)).retval == SHOT
    assert (lab.stat("external_dropped"), lab.stat("external_rejected")) == (1, 0)


def test_port_unreachable_quotes_ipv4_options(lab):
    lab.add_service(Frontend(h.NODE4, 30080, UDP_P), [])
    options = [IPOption_RR(routers=["1.2.3.4", "5.6.7.8", "9.9.9.9"])]
    original = frame(h.CLIENT4, h.NODE4, 40000, 30080, UDP_P, ip_options=options)
    ihl = Ether(original)[IP].ihl * 4
    result = lab.ingress(original)
    assert result.retval == REDIRECT
    assert h.checksums_valid(result.data)
    assert result.data[14 + 20 + 8 :] == original[14 : 14 + ihl + 8]


# --- loadBalancerSourceRanges ---


@pytest.mark.parametrize("version", [4, 6])
def test_source_ranges_let_listed_sources_in_and_drop_the_rest(lab, version):
    a = FAMILIES[version]
    service_id = lab.add_service(
        Frontend(a["lb"], 80, TCP_P), [(a["local"], 8080)], flags=abi.SVC_F_SOURCE_RANGES
    )
    lab.allow_source(service_id, "198.51.100.0/24" if version == 4 else "2001:db8:c::/64")
    allowed = lab.ingress(frame(a["client"], a["lb"], 40000, 80, TCP_P))
    assert allowed.retval == PASS
    assert_tuple(allowed.data, a["client"], 40000, a["local"], 8080)
    denied = lab.ingress(frame(a["other_client"], a["lb"], 40000, 80, TCP_P))
    assert denied.retval == SHOT
    assert lab.stat("external_dropped") == 1
    assert lab.stat("external_translated") == 1


def test_source_ranges_of_another_service_do_not_count(lab):
    a = FAMILIES[4]
    first = lab.add_service(Frontend(a["lb"], 80, TCP_P), [(a["local"], 8080)])
    lab.allow_source(first, "0.0.0.0/0")
    lab.add_service(
        Frontend(a["lb"], 81, TCP_P), [(a["local"], 8080)], flags=abi.SVC_F_SOURCE_RANGES
    )
    assert lab.ingress(frame(a["client"], a["lb"], 40000, 81, TCP_P)).retval == SHOT


# --- backend choice ---


def backend_of(lab, data: bytes) -> str:
    result = lab.ingress(data)
    assert result.retval == PASS
    return ip_layer(Ether(result.data)).dst


LOCAL_PODS = [f"10.244.0.{i}" for i in range(10, 15)]


def test_flows_spread_over_backends_without_affinity(lab):
    lab.add_service(Frontend(h.NODE4, 30080, TCP_P), [(pod, 8080) for pod in LOCAL_PODS])
    seen = {
        backend_of(lab, frame(h.CLIENT4, h.NODE4, port, 30080, TCP_P))
        for port in range(40000, 40060)
    }
    assert len(seen) > 1 and seen <= set(LOCAL_PODS)


def test_a_small_frontends_slot_block_is_read_before_its_slot_entries(lab):
    """TC takes a slot as the socket hooks do (bpf/lb.h): from the frontend's slot
    block when it has one and the block's entry is not 0, else from kpr_slots."""
    fe = Frontend(h.NODE4, 30080, TCP_P)
    service_id = lab.add_service(fe, [(LOCAL_PODS[0], 8080)])
    lab.add_service(Frontend(h.NODE4, 1, TCP_P), [(LOCAL_PODS[1], 8080)])
    in_block = lab.backend_ids(Frontend(h.NODE4, 1, TCP_P))[0]
    try:
        lab.set_block(service_id, [in_block])
        assert backend_of(lab, frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P)) == LOCAL_PODS[1]
        lab.set_block(service_id, [])
        assert backend_of(lab, frame(h.CLIENT4, h.NODE4, 40001, 30080, TCP_P)) == LOCAL_PODS[0]
    finally:
        lab.set_block(service_id, [])


@pytest.mark.parametrize("version", [4, 6])
def test_session_affinity_keeps_a_client_on_one_backend(lab, version):
    a = FAMILIES[version]
    pods = LOCAL_PODS if version == 4 else [f"fd00:10:244::{i}" for i in range(10, 15)]
    service_id = lab.add_service(
        Frontend(a["node"], 30080, TCP_P), [(pod, 8080) for pod in pods], affinity_timeout=60
    )
    chosen = {
        backend_of(lab, frame(a["client"], a["node"], port, 30080, TCP_P))
        for port in range(40000, 40040)
    }
    assert len(chosen) == 1
    key = abi.AffinityExtKey(service_id=service_id)
    ct.memmove(key.address, h.addr16(a["client"]), 16)
    sticky = lab.get("kpr_affinity_ext", key, abi.Affinity)
    assert sticky is not None and 1 <= sticky.slot <= len(pods)


def test_session_affinity_moves_when_the_backend_leaves_its_slot(lab):
    fe = Frontend(h.NODE4, 30080, TCP_P)
    service_id = lab.add_service(fe, [(pod, 8080) for pod in LOCAL_PODS], affinity_timeout=60)
    first = backend_of(lab, frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P))
    # the agent moves another backend into every slot
    ids = lab.backend_ids(fe)
    replacement = lab.add_service(Frontend(h.NODE4, 1, TCP_P), [("10.244.0.99", 8080)])
    del replacement
    new_id = lab.backend_ids(Frontend(h.NODE4, 1, TCP_P))[0]
    for slot in range(1, len(ids) + 1):
        lab.set_slot(service_id, slot, new_id)
    later = backend_of(lab, frame(h.CLIENT4, h.NODE4, 40001, 30080, TCP_P))
    assert first != later == "10.244.0.99"


def test_a_new_connection_on_a_flow_whose_backend_is_gone_starts_over(lab):
    fe = Frontend(h.NODE4, 30080, TCP_P)
    service_id = lab.add_service(fe, [(h.LOCAL_POD4, 8080)])
    assert backend_of(lab, frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P)) == h.LOCAL_POD4
    old_id = lab.backend_ids(fe)[0]
    # the endpoint goes: another backend takes the slot, the old one is deleted
    lab.add_service(Frontend(h.NODE4, 1, TCP_P), [("10.244.0.11", 8080)])
    new_id = lab.backend_ids(Frontend(h.NODE4, 1, TCP_P))[0]
    lab.set_slot(service_id, 1, new_id)
    lab.delete_backend(old_id, v6=False)
    # packets of the established connection still follow it...
    ack = frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P, flags="A")
    assert backend_of(lab, ack) == h.LOCAL_POD4
    # ...a SYN reusing the tuple is a new connection
    assert backend_of(lab, frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P)) == "10.244.0.11"
    stale_reply = flow_key(h.LOCAL_POD4, h.CLIENT4, 8080, 40000, TCP_P)
    assert lab.get("kpr_nat", stale_reply, abi.Nat) is None


@pytest.mark.parametrize("local", [True, False], ids=["local", "remote"])
def test_a_reply_entry_evicted_from_the_lru_is_written_again(lab, local):
    a = FAMILIES[4]
    backend = a["local"] if local else a["remote"]
    lab.add_service(Frontend(a["node"], 30080, TCP_P), [(backend, 8080)])
    first = lab.ingress(frame(a["client"], a["node"], 40000, 30080, TCP_P))
    sport = Ether(first.data)[TCP].sport
    src = Ether(first.data)[IP].src
    reply_key = flow_key(backend, src, 8080, sport, TCP_P)
    table = lab.table("kpr_nat")
    del table[table.Key.from_buffer_copy(bytes(reply_key))]
    lab.ingress(frame(a["client"], a["node"], 40000, 30080, TCP_P, flags="A"))
    restored = lab.get("kpr_nat", reply_key, abi.Nat)
    assert restored is not None and restored.client_port == 40000
    assert restored.flags == (0 if local else abi.CT_F_SNAT)


def test_master_counting_a_missing_backend_drops(lab):
    fe = Frontend(h.NODE4, 30080, TCP_P)
    lab.add_service(fe, [(h.LOCAL_POD4, 8080)])
    lab.delete_backend(lab.backend_ids(fe)[0], v6=False)
    assert lab.ingress(frame(h.CLIENT4, h.NODE4, 40000, 30080, TCP_P)).retval == SHOT
    assert lab.stat("backend_missing") == 1


# --- fuzzing: never fails, never corrupts ---


def _same_residual(a: int | None, b: int | None) -> bool:
    if a is None or b is None:
        return a == b
    return a % 0xFFFF == b % 0xFFFF  # one's complement: 0x0000 and 0xffff are both zero


def check_output(data: bytes, result: bpfsys.ProgRun) -> None:
    """Untouched, dropped, an ICMP error quoting the input, or the input translated:
    same length, same payload, checksums exactly as (in)valid as they were."""
    assert result.retval in (PASS, SHOT, REDIRECT, h.TC_ACT_OK)
    out = result.data
    if out == data or result.retval == SHOT:
        return
    parts = h.layout(out)
    assert parts is not None
    if parts.protocol in (1, 58) and h.layout(data).protocol not in (1, 58):
        assert h.checksums_valid(out)
        packet = Ether(out)
        assert ICMP in packet or ICMPv6DestUnreach in packet
        quote_from = 14 + (20 if parts.version == 4 else 40) + 8
        assert data[14 : 14 + len(out) - quote_from] == out[quote_from:]
        return
    assert len(out) == len(data)
    before = h.layout(data)
    assert before is not None and (before.version, before.protocol) == (
        parts.version,
        parts.protocol,
    )
    assert _same_residual(h.ip_header_residual(data), h.ip_header_residual(out))
    assert _same_residual(h.l4_residual(data), h.l4_residual(out))
    header = 20 if parts.protocol == TCP_P else 8
    assert parts.l4[header:] == before.l4[header:]  # payload
    if h.checksums_valid(data):
        assert h.checksums_valid(out)


def _fuzz_services(lab) -> list[bytes]:
    """Frontends of every kind, and frames that reach them (the seeds to mutate)."""
    seeds = []
    for version, protocol in MATRIX:
        a = FAMILIES[version]
        lab.add_service(Frontend(a["node"], 30080, protocol), [(a["local"], 8080)])
        lab.add_service(Frontend(a["lb"], 80, protocol), [(a["remote"], 8080)])
        lab.add_service(Frontend(a["lb"], 81, protocol), [])
        for port in (30080, 80, 81):
            dst = a["node"] if port == 30080 else a["lb"]
            seeds.append(frame(a["client"], dst, 40000, port, protocol))
        seeds.append(frame(a["local"], a["client"], 8080, 40000, protocol))  # local reply
        result = lab.ingress(frame(a["client"], a["lb"], 40001, 80, protocol))
        nat_port = l4_layer(Ether(result.data)).sport
        seeds.append(frame(a["remote"], a["node"], 8080, nat_port, protocol))  # remote reply
    options = [IPOption_RR(routers=["1.2.3.4"])]
    seeds.append(frame(h.CLIENT4, h.NODE4, 40002, 30080, TCP_P, ip_options=options))
    seeds.append(frame(h.CLIENT4, h.NODE4, 40003, 30080, UDP_P, udp_checksum=0))
    return seeds


FUZZ = settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(st.binary(min_size=14, max_size=300))
def test_fuzz_random_bytes(lab, data):
    for direction in ("ingress", "egress"):
        result = run(lab, direction, data)
        if result is not None:
            check_output(data, result)


def test_fuzz_mutated_service_packets(lab):
    seeds = _fuzz_services(lab)

    @FUZZ
    @given(
        st.sampled_from(seeds),
        st.lists(st.tuples(st.integers(0, 120), st.integers(0, 255)), max_size=4),
        st.integers(0, 3),
        st.binary(max_size=16),
        st.booleans(),
    )
    def mutate(seed, flips, cut, tail, fix_checksums):
        data = bytearray(seed)
        for position, value in flips:
            if position < len(data):
                data[position] = value
        data = bytes(data[: len(data) - cut]) + tail
        if len(data) < 14:
            return
        if fix_checksums:  # a mutation that still verifies: scapy recomputes the checksums
            packet = Ether(data)
            for layer in (IP, TCP, UDP):
                if layer in packet:
                    del packet[layer].chksum
            data = bytes(packet)
            if len(data) < 14:
                return
        for direction in ("ingress", "egress"):
            result = run(lab, direction, data)
            if result is not None:
                check_output(data, result)

    mutate()


# --- tc.py: attachment in a namespace, kpr_devices ---


def _filters(lab, device: str, hook: str) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", lab.netns, "tc", "filter", "show", "dev", device, hook],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_attach_replaces_in_place_and_detach_removes_only_kpr_filters(lab):
    from pyroute2 import IPRoute

    with lab.inside():
        try:
            with IPRoute() as ipr:  # another tool's clsact and filter, there first
                index = ipr.link_lookup(ifname="pod0")[0]
                ipr.tc("add", "clsact", index)
                ipr.tc(
                    "add-filter",
                    "bpf",
                    index,
                    7,
                    fd=lab.fds["egress"],
                    name="other_tool",
                    parent=tc.TC_H_CLSACT_INGRESS,
                    prio=10,
                    direct_action=True,
                )
                # an older kpr's filter at another priority
                ipr.tc(
                    "add-filter",
                    "bpf",
                    index,
                    3,
                    fd=lab.fds["egress"],
                    name="kpr_tc_ingress",
                    parent=tc.TC_H_CLSACT_INGRESS,
                    prio=5,
                    direct_action=True,
                )
            assert tc.attached(["pod0", "ext0"]) == {"pod0": False, "ext0": False}
            tc.attach(lab.pin_dir, ["pod0", "ext0"])
            assert tc.attached(["pod0", "ext0"], lab.pin_dir) == {"pod0": True, "ext0": True}
            tc.attach(lab.pin_dir, ["pod0"])  # again: replaced, not doubled
            ingress = _filters(lab, "pod0", "ingress")
            assert ingress.count("kpr_tc_ingress direct-action") == 1
            assert "other_tool" in ingress and f"pref {tc.PRIORITY} " in ingress
            assert "pref 5 " not in ingress
            assert _filters(lab, "pod0", "egress").count("kpr_tc_egress direct-action") == 1
            assert tc.detach(["pod0", "ext0", "nonexistent0"]) == 4
            assert tc.attached(["pod0"]) == {"pod0": False}
            assert "other_tool" in _filters(lab, "pod0", "ingress")
            assert (
                "clsact"
                in subprocess.run(
                    ["ip", "netns", "exec", lab.netns, "tc", "qdisc", "show", "dev", "pod0"],
                    capture_output=True,
                    text=True,
                ).stdout
            )
        finally:
            tc.detach(["pod0", "ext0"])
            subprocess.run(
                ["ip", "netns", "exec", lab.netns, "tc", "qdisc", "del", "dev", "pod0", "clsact"],
                capture_output=True,
            )


def test_attach_errors_name_the_device_and_the_fix(lab):
    with lab.inside():
        with pytest.raises(host.SetupError, match="no network device 'nope0'"):
            tc.attach(lab.pin_dir, ["nope0"])
        subprocess.run(["tc", "qdisc", "add", "dev", "pod0p", "ingress"], check=True)
        try:
            with pytest.raises(host.SetupError, match="`ingress` qdisc"):
                tc.attach(lab.pin_dir, ["pod0p"])
        finally:
            subprocess.run(["tc", "qdisc", "del", "dev", "pod0p", "ingress"], check=False)


def test_write_devices_replaces_the_whole_map(lab):
    lab.set_devices({"ext0": (h.NODE4, h.NODE6), "pod0": ("10.244.0.1", None)})
    rows = {k.value: v for k, v in lab.entries("kpr_devices", ct.c_uint32, abi.Device)}
    assert bytes(rows[lab.ifindex["ext0"]].address4) == ipaddress.ip_address(h.NODE4).packed
    assert bytes(rows[lab.ifindex["pod0"]].address6) == bytes(16)
    lab.set_devices({"pod0": (None, "fd00:10:244::1")})
    rows = {k.value: v for k, v in lab.entries("kpr_devices", ct.c_uint32, abi.Device)}
    assert list(rows) == [lab.ifindex["pod0"]]
    with lab.inside():  # what the agent writes there: kpr.node.devices reads the addresses
        ext0 = read_devices()[0]["ext0"]
    assert (ext0.index, str(ext0.first(4)), str(ext0.first(6))) == (
        lab.ifindex["ext0"],
        h.NODE4,
        h.NODE6,
    )


def test_attach_without_pinned_programs_says_so(tmp_path):
    with pytest.raises(host.SetupError, match="not pinned"):
        tc.attach(tmp_path, ["lo"])


@pytest.mark.parametrize(
    "code,fix",
    [
        (errno.EPERM, "CAP_NET_ADMIN"),
        (errno.EOPNOTSUPP, "CONFIG_NET_SCH_INGRESS"),
        (errno.ENOENT, "CONFIG_NET_CLS_BPF"),
        (errno.EBUSY, "tc qdisc show dev eth7"),
    ],
)
def test_netlink_errors_become_setup_errors_naming_device_and_fix(code, fix):
    from kpr.node.rtnetlink import NetlinkError

    err = tc._setup_error("eth7", "add a clsact qdisc", NetlinkError(code, os.strerror(code)))
    assert "'eth7'" in str(err) and fix in str(err)
