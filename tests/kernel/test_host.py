"""Set-up errors that tell the user what to do, on paths the other tests cannot reach: pinned
maps on bpffs (the mount checks that need no kernel are in tests/unit/node/test_host.py)."""

from __future__ import annotations

import pytest

from kpr.datapath import abi, loader
from kpr.node import host


def test_a_pinned_map_of_another_size_is_refused_naming_it(pin_dir):
    loader.compile_and_pin(pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    with pytest.raises(host.SetupError, match=rf"{abi.PIN_PREFIX}services4.*kpr cleanup"):
        loader.check_pinned_maps(pin_dir, abi.MapSizes(2048, 1024, 1024, 1024, 1024))
    loader.check_pinned_maps(pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024))  # same: fine


def test_cleanup_removes_retired_maps_and_other_versions_pins(pin_dir):
    loader.compile_and_pin(pin_dir, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    retired = loader.retire_mismatched_maps(pin_dir, abi.MapSizes(2048, 1024, 1024, 1024, 1024))
    prefix = abi.PIN_PREFIX
    assert [r.split()[0] for r in retired] == [f"{prefix}services4", f"{prefix}services6"]
    assert (pin_dir / f"retired_{prefix}services4").exists()
    loader.unpin_all(pin_dir)
    assert not pin_dir.exists()
