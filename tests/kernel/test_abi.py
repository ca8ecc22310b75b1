"""kpr/datapath/abi.py against what BCC compiles from bpf (the byte-level checks that
need no kernel are in tests/unit/datapath/test_abi.py)."""

from __future__ import annotations

import ctypes as ct

from kpr.datapath import abi


def _layout(ctype) -> list[tuple[str, int, int]]:
    if not hasattr(ctype, "_fields_"):
        return [("", 0, ct.sizeof(ctype))]
    return [
        (name, getattr(ctype, name).offset, getattr(ctype, name).size)
        for name, *_ in ctype._fields_
    ]


def test_ctypes_mirror_matches_the_structs_bcc_compiles(compiled_bpf):
    for spec in abi.MAPS.values():
        table = compiled_bpf[spec.name.encode()]
        assert ct.sizeof(table.Key) == spec.key_size, spec.name
        leaf_size = ct.sizeof(table.Leaf)
        if spec.map_type == abi.BPF_MAP_TYPE_PERCPU_ARRAY:
            leaf_size = ct.sizeof(table.sLeaf)
        assert leaf_size == spec.value_size, spec.name
        if hasattr(spec.key, "_fields_"):
            assert _layout(table.Key) == _layout(spec.key), spec.name
        if hasattr(spec.value, "_fields_"):
            assert _layout(table.Leaf) == _layout(spec.value), spec.name


def test_compiled_maps_have_the_sizes_abi_py_passes(compiled_bpf):
    sizes = abi.MapSizes(1024, 1024, 1024, 1024, 1024)  # as conftest compiles them
    for spec in abi.MAPS.values():
        table = compiled_bpf[spec.name.encode()]
        assert table.max_entries == sizes.max_entries(spec), spec.name
