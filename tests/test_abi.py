"""kpr/datapath/abi.py must describe the same bytes as bpf/kpr.h."""

from __future__ import annotations

import ctypes as ct

from kpr.datapath import abi
from kpr.datapath.loader import HOOKS


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


def test_every_hook_function_exists_in_the_program_source():
    source = (abi.BPF_DIR / "sock_lb.c").read_text()
    for hook in HOOKS:
        assert f"int {hook.function}(struct bpf_sock_addr *ctx)" in source


def test_slot_limit_and_version_match_the_header():
    header = (abi.BPF_DIR / "kpr.h").read_text()
    assert f"#define KPR_MAX_SLOTS {abi.MAX_SLOTS}\n" in header
    assert f"#define KPR_ABI_VERSION {abi.ABI_VERSION}\n" in header
    assert f'"/v{abi.ABI_VERSION}_" name' in header
