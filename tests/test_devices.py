"""`--devices` and the NodePort addresses (kpr/devices.py): pure selection, no root."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from kpr.devices import Device, node_port_addresses, select_devices
from kpr.host import SetupError

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
