"""`--devices` and the NodePort addresses (kpr/node/devices.py): pure selection, no root."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from kpr.datapath import abi
from kpr.datapath.tc import device_entries
from kpr.node.devices import (
    Device,
    DeviceChoice,
    node_port_addresses,
    reply_devices,
    select_devices,
)
from kpr.node.host import SetupError

ETH0 = Device("eth0", 2, (ip_address("192.168.50.1"), ip_address("fd00:50::1")))
ETH1 = Device("eth1", 3, (ip_address("10.0.0.5"), ip_address("192.168.60.1")))
DEVICES = {"lo": Device("lo", 1), "eth0": ETH0, "eth1": ETH1}


def test_auto_takes_the_default_route_devices_none_takes_nothing():
    assert select_devices("auto", DEVICES, {"eth1"}) == [ETH1]
    assert select_devices("none", DEVICES, {"eth1"}) == []
    assert select_devices("eth0, eth1", DEVICES, set()) == [ETH0, ETH1]


def test_an_unknown_device_is_named_with_the_ones_there_are():
    with pytest.raises(SetupError, match=r"no device 'eth9'.*eth0, eth1, lo"):
        select_devices("eth0,eth9", DEVICES, set())


def test_node_port_addresses_narrowed_by_cidrs_or_primary():
    every = node_port_addresses([ETH0, ETH1], [])
    assert [str(a) for a in every] == ["192.168.50.1", "fd00:50::1", "10.0.0.5", "192.168.60.1"]
    narrowed = node_port_addresses([ETH0, ETH1], ["192.168.0.0/16"])
    assert [str(a) for a in narrowed] == ["192.168.50.1", "192.168.60.1"]
    primary = node_port_addresses([ETH0, ETH1], ["primary"])
    assert [str(a) for a in primary] == ["192.168.50.1", "fd00:50::1"]


VXLAN = Device("vxlan0", 4, (ip_address("172.31.0.1"),))
POD1 = Device("veth1", 5)  # a pod's host-side veth: no address
WITH_LO = {**DEVICES, "vxlan0": VXLAN, "veth1": POD1, "lo": Device("lo", 1, loopback=True)}


def test_auto_also_takes_the_devices_holding_the_nodes_internal_ips():
    chosen = select_devices("auto", DEVICES, {"eth1"}, [ip_address("192.168.50.1")])
    assert chosen == [ETH0, ETH1]
    assert select_devices("auto", DEVICES, set(), [ip_address("fd00:50::1")]) == [ETH0]


def test_patterns_take_every_matching_device_and_may_match_none():
    assert select_devices("eth*", DEVICES, set()) == [ETH0, ETH1]
    assert select_devices("eth1,eth*", DEVICES, set()) == [ETH1, ETH0]
    assert select_devices("bond*", DEVICES, set()) == []


def test_a_named_device_gone_at_run_time_is_left_out():
    assert select_devices("eth0,eth9", DEVICES, set(), strict=False) == [ETH0]


def test_every_other_device_with_an_address_is_one_for_replies():
    assert reply_devices(WITH_LO, [ETH0]) == [ETH1, VXLAN]  # not veth1, not lo


def test_kpr_devices_entries_flag_the_reply_devices_and_hold_the_node_address():
    entries = device_entries(DeviceChoice((ETH0,), (VXLAN,)))
    assert entries == {
        abi.NODE_ADDRESS_INDEX: (ETH0.addresses[0], ETH0.addresses[1], 0),
        ETH0.index: (ETH0.addresses[0], ETH0.addresses[1], 0),
        VXLAN.index: (VXLAN.addresses[0], None, abi.DEVICE_F_REPLIES),
    }
    assert device_entries(DeviceChoice()) == {}  # --devices none: no TC program
