"""Which kernel headers BCC compiles against (the node's own, the kernel's kheaders, the set
kpr ships); `kpr run` serving on a node that has no headers at all is in
tests/kernel/test_kernel_headers.py."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from kpr.node import host

RELEASE = "6.99.0-test"


def headers_tree(root: Path, release: str, generated: bool = True) -> Path:
    """A flat headers tree as BCC checks it: include/linux/kconfig.h, and the generated
    autoconf.h and utsrelease.h a build leaves (a -common tree alone has neither)."""
    (root / "include/linux").mkdir(parents=True)
    (root / host.KCONFIG_H).write_text("#include <generated/autoconf.h>\n")
    if generated:
        (root / "include/generated").mkdir()
        (root / "include/generated/autoconf.h").write_text("#define CONFIG_BPF 1\n")
        (root / "include/generated/utsrelease.h").write_text(f'#define UTS_RELEASE "{release}"\n')
    return root


def kheaders_archive(path: Path, release: str) -> Path:
    """A /sys/kernel/kheaders.tar.xz lookalike: ./include/... and ./arch/..., as the kernel's."""
    with tarfile.open(path, "w:xz") as tar:
        for name, text in (
            ("./include/linux/kconfig.h", "#include <generated/autoconf.h>\n"),
            ("./include/generated/utsrelease.h", f'#define UTS_RELEASE "{release}"\n'),
            ("./arch/x86/include/asm/page.h", "\n"),
        ):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def places(tmp_path, monkeypatch):
    """Empty stand-ins for /lib/modules, kheaders, the shipped set and /run/kpr."""
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    (tmp_path / "modules" / RELEASE).mkdir(parents=True)
    return {
        "modules": tmp_path / "modules",
        "kheaders": tmp_path / "kheaders.tar.xz",
        "shipped": tmp_path / "shipped",
        "extract_to": tmp_path / "run",
    }


def find(places) -> host.KernelHeaders:
    return host.find_kernel_headers(RELEASE, **places)


def test_the_nodes_own_headers_come_before_kheaders_and_the_shipped_set(places):
    build = headers_tree(places["modules"] / RELEASE / "build", RELEASE)
    kheaders_archive(places["kheaders"], RELEASE)
    headers_tree(places["shipped"], "6.1.0-57-amd64")
    assert find(places) == host.KernelHeaders("node", build, RELEASE)
    assert not places["extract_to"].exists()  # kheaders left packed


def test_debians_split_build_and_source_is_the_nodes_own(places):
    # linux-headers-<v>-amd64 (generated files) as build/, -common (the rest) as source/
    build = places["modules"] / RELEASE / "build"
    (build / "include/generated").mkdir(parents=True)
    (build / "include/generated/autoconf.h").write_text("\n")
    (build / "include/generated/utsrelease.h").write_text(f'#define UTS_RELEASE "{RELEASE}"\n')
    headers_tree(places["modules"] / RELEASE / "source", RELEASE, generated=False)
    assert find(places) == host.KernelHeaders("node", build, RELEASE)


def test_kheaders_come_next_unpacked_for_the_compile_and_removed_after(places, monkeypatch):
    # a build/ left behind without headers (BCC looks for kconfig.h too, not the directory)
    (places["modules"] / RELEASE / "build" / "include").mkdir(parents=True)
    kheaders_archive(places["kheaders"], RELEASE)
    headers_tree(places["shipped"], "6.1.0-57-amd64")
    places["extract_to"].mkdir()
    found = find(places)
    assert (found.origin, found.release) == ("kheaders", RELEASE)
    assert found.path.parent == places["extract_to"]
    assert (found.path / "arch/x86/include/asm/page.h").is_file()
    assert found.path.stat().st_mode & 0o077 == 0  # root's alone: BCC compiles what is there
    # the agent's way: BCC pointed at them while it compiles, nothing left once loaded
    monkeypatch.setattr(host, "find_kernel_headers", lambda: found)
    with host.kernel_headers() as headers:
        assert os.environ["BCC_KERNEL_SOURCE"] == str(found.path)
        assert headers == found
    assert "BCC_KERNEL_SOURCE" not in os.environ
    assert not found.path.exists()


def test_a_kheaders_archive_that_cannot_be_read_is_named(places):
    places["kheaders"].write_bytes(b"not xz")
    places["extract_to"].mkdir()
    with pytest.raises(host.SetupError, match="kheaders.tar.xz"):
        find(places)
    assert list(places["extract_to"].iterdir()) == []


def test_the_shipped_set_is_the_last_resort(places):
    shipped = headers_tree(places["shipped"], "6.1.0-57-amd64")
    assert find(places) == host.KernelHeaders("shipped", shipped, "6.1.0-57-amd64")
    assert "shipped with kpr" in str(find(places))


def test_no_headers_anywhere_names_each_place_and_the_fix(places):
    with pytest.raises(host.SetupError) as err:
        find(places)
    message = str(err.value)
    for place in (places["modules"] / RELEASE / "build", places["kheaders"], places["shipped"]):
        assert str(place) in message
    assert "host-setup.sh" in message and "BCC_KERNEL_SOURCE" in message


def test_bcc_kernel_source_overrides_everything_and_is_not_second_guessed(places, monkeypatch):
    headers_tree(places["modules"] / RELEASE / "build", RELEASE)
    chosen = headers_tree(places["shipped"].with_name("chosen"), "5.15.0")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(chosen))
    assert find(places) == host.KernelHeaders("BCC_KERNEL_SOURCE", chosen, "5.15.0")
    monkeypatch.setenv("BCC_KERNEL_SOURCE", str(chosen.with_name("absent")))
    with pytest.raises(host.SetupError, match="BCC_KERNEL_SOURCE=.*absent"):
        find(places)


@pytest.mark.parametrize(("origin", "exported"), [("node", False), ("shipped", True)])
def test_bcc_is_pointed_at_a_merged_tree_only(monkeypatch, tmp_path, origin, exported):
    # BCC reads the node's split build/ + source/ only from /lib/modules itself: with
    # BCC_KERNEL_SOURCE it would take one of them for the whole tree
    environ = {k: v for k, v in os.environ.items() if k != "BCC_KERNEL_SOURCE"}
    monkeypatch.setattr(os, "environ", environ)  # what it sets goes with the test
    headers = host.KernelHeaders(origin, tmp_path, "6.1.0")
    monkeypatch.setattr(host, "find_kernel_headers", lambda: headers)
    assert host.require_kernel_headers() == headers
    assert environ.get("BCC_KERNEL_SOURCE") == (str(tmp_path) if exported else None)
