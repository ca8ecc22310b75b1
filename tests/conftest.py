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
from tests.support.kernel import skip_unless_kernel_ready
from tests.support.paths import REPO

# The lab and the bench (lab/, bench/) are not installed, only kpr is: the `python -m lab...`
# and `python -m bench...` the tests start find them in this checkout, wherever pytest runs.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def lab():
    """A node netns with three pods and a client cgroup, shared by a module's tests."""
    skip_unless_kernel_ready()
    from lab.netns import Lab

    with Lab(pods=3) as made:
        yield made


@pytest.fixture
def api():
    """The test API server (tests/support/apiserver.py), bookmarks every half second."""
    from tests.support.apiserver import TestApiServer

    with TestApiServer(bookmark_interval=0.5) as server:
        yield server


@pytest.fixture
def pin_dir():
    """A pin directory of this test's own on bpffs, removed afterwards."""
    skip_unless_kernel_ready()
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
    skip_unless_kernel_ready()
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
    skip_unless_kernel_ready()
    from kpr.datapath import abi, loader

    path = Path("/sys/fs/bpf") / f"kpr-abi-{uuid.uuid4().hex[:8]}"
    host.ensure_bpffs(path)
    try:
        yield loader.compile_and_pin(path, abi.MapSizes(1024, 1024, 1024, 1024, 1024))
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def kube_bin():
    """The upstream binaries (lab.kube.build; `make test` builds them first where Go is)."""
    from lab.kube import build

    try:
        build.find_go()
    except build.GoMissing as err:
        pytest.skip(f"{err}: tests against the real Kubernetes components need it")
    return build.build()


@pytest.fixture(scope="module")
def control_plane(kube_bin, tmp_path_factory, request):
    """etcd, kube-apiserver, kube-controller-manager and kube-scheduler for a module's tests
    (with the module's CONTROLLER_MANAGER_ARGS, if it has any)."""
    skip_unless_kernel_ready()  # its advertise address lives in a network namespace
    from lab.kube.controlplane import ControlPlane

    extra = list(getattr(request.module, "CONTROLLER_MANAGER_ARGS", []))
    directory = tmp_path_factory.mktemp("kube")
    with ControlPlane(kube_bin, directory, extra_controller_manager_args=extra) as plane:
        yield plane


_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    """Markers by directory: tests/kernel needs root, BPF and network namespaces; tests/e2e
    needs those and runs the lab, real Kubernetes components, the bench or the soak, so
    `pytest -m "not kernel"` runs tests/unit alone."""
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(_TESTS).parts
        if parts[0] == "kernel":
            item.add_marker(pytest.mark.kernel)
        elif parts[0] == "e2e":
            item.add_marker(pytest.mark.kernel)
            item.add_marker(pytest.mark.slow)
