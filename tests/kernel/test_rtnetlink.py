"""kpr's own rtnetlink (kpr/node/rtnetlink.py) against iproute2 in a network namespace of the
test's own: the same links, addresses and default routes as `ip -j` lists, and the kernel's
refusals as errors with their errno. (Its TC requests are run by every test that attaches kpr's
TC programs: tests/kernel/test_nodeport*.py.)"""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from kpr.node.devices import read_devices
from kpr.node.rtnetlink import TC_H_CLSACT, NetlinkError, Rtnl
from tests.support.kernel import skip_unless_kernel_ready
from tests.support.tc_harness import inside

SETUP = """
ip link set lo up
ip link add ext0 type veth peer name ext1
ip link add pod0 type veth peer name pod1
ip addr add 192.0.2.10/24 dev ext0
ip addr add 192.0.2.11/24 dev ext0
ip -6 addr add 2001:db8::10/64 dev ext0 nodad
ip addr add 10.244.0.1/24 dev pod0
ip link set ext0 up
ip link set ext1 up
ip link set pod0 up
ip link set pod1 up
ip route add default via 192.0.2.1 dev ext0
ip -6 route add default via 2001:db8::1 dev ext0
ip route add 198.51.100.0/24 dev pod0
"""


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    skip_unless_kernel_ready()
    name = f"kpr-rtnl-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for line in filter(None, SETUP.splitlines()):
            subprocess.run(["ip", "-n", name, *line.split()[1:]], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def ip_json(name: str, *argv: str) -> list[dict]:
    done = subprocess.run(["ip", "-n", name, "-j", *argv], capture_output=True, check=True)
    return json.loads(done.stdout)


def test_links_addresses_and_default_routes_are_those_ip_lists(netns):
    with inside(netns), Rtnl() as rtnl:
        links = {name: index for index, name, _ in rtnl.links()}
        addresses = sorted(
            (index, scope, socket.inet_ntop(socket.AF_INET if len(a) == 4 else socket.AF_INET6, a))
            for index, scope, a in rtnl.addresses()
        )
        defaults = {
            family: rtnl.default_route_devices(family)
            for family in (socket.AF_INET, socket.AF_INET6)
        }
    assert links == {link["ifname"]: link["ifindex"] for link in ip_json(netns, "link")}
    scopes = {"global": 0, "link": 253, "host": 254}
    assert addresses == sorted(
        (link["ifindex"], scopes[a["scope"]], a["local"])
        for link in ip_json(netns, "addr")
        for a in link["addr_info"]
    )
    assert defaults == {socket.AF_INET: [links["ext0"]], socket.AF_INET6: [links["ext0"]]}


def test_devices_read_through_it(netns):
    with inside(netns):
        devices, default = read_devices()
    assert default == {"ext0"}
    assert [str(a) for a in devices["ext0"].addresses] == [
        "192.0.2.10",
        "192.0.2.11",
        "2001:db8::10",
    ]
    assert devices["lo"].loopback and devices["lo"].addresses == ()  # host scope: left out


def test_refusals_carry_the_kernels_errno(netns):
    with inside(netns), Rtnl() as rtnl:
        index = socket.if_nametoindex("pod0")
        rtnl.add_clsact(index)
        assert "clsact" in rtnl.qdisc_kinds(index)
        with pytest.raises(NetlinkError) as refused:
            rtnl.add_clsact(index)
        assert refused.value.code == errno.EEXIST
        with pytest.raises(NetlinkError) as refused:
            rtnl.delete_filter(index, TC_H_CLSACT + 1, 1 << 16, 1)
        assert refused.value.code == errno.ENOENT
        assert list(rtnl.filters(index, TC_H_CLSACT + 1)) == []
        # the socket is still in step after refusals: the next dump answers
        assert (index, "pod0") in [(i, n) for i, n, _ in rtnl.links()]
