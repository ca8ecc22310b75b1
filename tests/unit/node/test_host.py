"""Set-up errors that tell the user what to do, on paths the other tests cannot reach: the
mounts (pinned maps on bpffs are in tests/kernel/test_host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

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
