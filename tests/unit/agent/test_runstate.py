"""The run state files `kpr status` reads: the desired state, written in chunks."""

from __future__ import annotations

from ipaddress import ip_address, ip_network
from pathlib import Path

import pytest

from kpr.agent import runstate
from kpr.model import Backend, Frontend, FrontendState, Translation


def test_the_desired_state_written_in_chunks_reads_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runstate, "RUN_DIR", tmp_path / "run")
    monkeypatch.setattr(runstate, "DESIRED_CHUNK", 1)  # each frontend a chunk of its own
    pin_dir = tmp_path / "pins"
    web = FrontendState(
        "shop/web:http",
        (Backend(ip_address("10.244.1.5"), 8080), Backend(ip_address("10.244.2.7"), 8080)),
        affinity_timeout=10800,
        kind="LoadBalancer",
        source_ranges=(ip_network("192.0.2.0/24"),),
        drop=True,
    )
    frontends = {
        Frontend(ip_address("fd00:96::a"), 53, "UDP"): FrontendState("kube-system/dns", ()),
        Frontend(ip_address("10.96.0.10"), 80, "TCP"): web,
    }
    state = runstate.RunState(str(pin_dir), "/sys/fs/cgroup", "test")
    state.record(Translation(frontends), set(), [], 1.0)
    written = runstate.desired_path(pin_dir).read_text()
    assert runstate.load_desired(pin_dir) == {
        "10.96.0.10:80/TCP": {
            "service": "shop/web:http",
            "backends": ["10.244.1.5:8080", "10.244.2.7:8080"],
            "affinity_timeout": 10800,
            "kind": "LoadBalancer",
            "source_ranges": ["192.0.2.0/24"],
            "drop": True,
        },
        "[fd00:96::a]:53/UDP": {
            "service": "kube-system/dns",
            "backends": [],
            "affinity_timeout": 0,
        },
    }
    assert written.index("10.96.0.10") < written.index("fd00:96::a")  # IPv4 first, as sorted
    state.record(None, set(), [], 2.0)  # unchanged: not written again
    assert runstate.desired_path(pin_dir).read_text() == written
    state.record(Translation(), set(), [], 3.0)
    assert runstate.load_desired(pin_dir) == {}
    assert not list(runstate.desired_path(pin_dir).parent.glob("*.tmp"))
