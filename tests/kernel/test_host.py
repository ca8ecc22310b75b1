"""Set-up errors that tell the user what to do, on paths the other tests cannot reach."""

from __future__ import annotations

from pathlib import Path

import pytest

from kpr.datapath import abi, loader
from kpr.node import host


def test_no_cgroup2_mount_says_how_to_mount_one(monkeypatch):
    monkeypatch.setattr(host, "mounts", lambda: [(Path("/sys/fs/cgroup/cpu"), "cgroup")])
    with pytest.raises(host.SetupError, match="mount -t cgroup2"):
        host.cgroup2_root()


def test_mount_points_with_escaped_spaces_are_read(monkeypatch, tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("41 31 0:38 / /sys/fs/my\\040cgroup rw,relatime - cgroup2 cgroup2 rw\n")
    real_path = Path

    def fake_path(*args):
        return info if args == ("/proc/self/mountinfo",) else real_path(*args)

    monkeypatch.setattr(host, "Path", fake_path)
    assert host.cgroup2_root() == Path("/sys/fs/my cgroup")


def test_a_pinned_map_of_another_size_is_refused_naming_it(pin_dir):
    loader.compile_and_pin(pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    with pytest.raises(host.SetupError, match=r"v1_services4.*kpr cleanup"):
        loader.check_pinned_maps(pin_dir, abi.MapSizes(2048, 1024, 1024, 1024, 1024))
    loader.check_pinned_maps(pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024))  # same: fine


def test_cleanup_removes_retired_maps_and_other_versions_pins(pin_dir):
    loader.compile_and_pin(pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    retired = loader.retire_mismatched_maps(pin_dir, abi.MapSizes(2048, 1024, 1024, 1024, 1024))
    assert [r.split()[0] for r in retired] == ["v1_services4", "v1_services6"]
    assert (pin_dir / "retired_v1_services4").exists()
    loader.unpin_all(pin_dir)
    assert not pin_dir.exists()
