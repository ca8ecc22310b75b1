"""Fixtures for tests on the real kernel: each probes for what it needs and
skips with the reason when it is missing, and cleans up even on failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from kpr.node import host


def _skip_unless_kernel_ready() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: loads BPF programs and makes network namespaces")
    try:
        host.require_bcc()
        host.require_kernel_headers()
        host.cgroup2_root()
    except host.SetupError as err:
        pytest.skip(str(err))
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` for network namespaces")


@pytest.fixture(scope="module")
def lab():
    """A node netns with three pods and a client cgroup, shared by a module's tests."""
    _skip_unless_kernel_ready()
    from kpr.lab.netns import Lab

    with Lab(pods=3) as made:
        yield made


@pytest.fixture
def api():
    """The test API server (tests/apiserver.py), bookmarks every half second."""
    from tests.apiserver import TestApiServer

    with TestApiServer(bookmark_interval=0.5) as server:
        yield server


@pytest.fixture
def pin_dir():
    """A pin directory of this test's own on bpffs, removed afterwards."""
    _skip_unless_kernel_ready()
    path = Path("/sys/fs/bpf") / f"kpr-test-{uuid.uuid4().hex[:8]}"
    host.ensure_bpffs(path)
    yield path
    from kpr.agent import runstate

    runstate.remove(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cgroup():
    """A child cgroup v2 directory; never the root, whose hooks would rewrite the
    whole machine's connections."""
    _skip_unless_kernel_ready()
    path = host.cgroup2_root() / f"kpr-test-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    yield path
    from kpr.datapath import loader

    loader.detach(path)
    for pid in (path / "cgroup.procs").read_text().split():
        subprocess.run(["kill", "-9", pid], check=False)
    path.rmdir()


@pytest.fixture(scope="session")
def compiled_bpf(tmp_path_factory):
    """The socket LB program compiled by BCC into a throwaway pin directory."""
    _skip_unless_kernel_ready()
    from kpr.datapath import abi, loader

    path = Path("/sys/fs/bpf") / f"kpr-abi-{uuid.uuid4().hex[:8]}"
    host.ensure_bpffs(path)
    try:
        yield loader.compile_and_pin(path, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def kube_bin():
    """The upstream binaries (kpr.lab.kube.build; `make test` builds them first where Go is)."""
    from kpr.lab.kube import build

    try:
        build.find_go()
    except build.GoMissing as err:
        pytest.skip(f"{err}: tests against the real Kubernetes components need it")
    return build.build()


@pytest.fixture(scope="module")
def control_plane(kube_bin, tmp_path_factory, request):
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler for a module's tests
    (with the module's CONTROLLER_MANAGER_ARGS, if it has any)."""
    _skip_unless_kernel_ready()  # its advertise address lives in a network namespace
    from kpr.lab.kube.controlplane import ControlPlane

    extra = list(getattr(request.module, "CONTROLLER_MANAGER_ARGS", []))
    directory = tmp_path_factory.mktemp("kube")
    with ControlPlane(kube_bin, directory, extra_controller_manager_args=extra) as plane:
        yield plane
