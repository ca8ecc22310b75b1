"""python -m lab.kube: the build's cache and version pins, and `up DIR` / `down DIR` as a
user (or a check outside the suite) runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kpr.node.host import process_alive
from lab.kube import build

KUBE = [sys.executable, "-m", "lab.kube"]


def test_versions_come_from_the_go_modules_and_every_staging_module_is_replaced():
    go_mod = (build.KUBERNETES_MODULE / "go.mod").read_text()
    version = build.kubernetes_version()
    assert version.startswith("v1.34.")
    staging = version.replace("v1.", "v0.", 1)
    replaced = [line.split()[0] for line in go_mod.splitlines() if "=>" in line]
    assert len(replaced) == 31  # Kubernetes 1.34's staging modules, each at the same tag
    assert all(f"=> {module} {staging}" in go_mod for module in replaced)
    assert build.required_version(build.ETCD_MODULE / "go.mod", "go.etcd.io/etcd/server/v3")


def test_without_go_build_says_so_and_if_go_exits_0(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no go on PATH
    fake_go = Path("/usr/local/go/bin/go")
    if fake_go.exists() or Path("/usr/lib/go/bin/go").exists():
        pytest.skip("Go is installed where lab.kube looks besides PATH")
    out = subprocess.run([*KUBE, "build"], capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "no Go toolchain found" in out.stderr
    out = subprocess.run([*KUBE, "build", "--if-go"], capture_output=True, text=True, env=env)
    assert out.returncode == 0


def test_build_reuses_its_cache_and_prints_the_binaries_directory_last(kube_bin):
    out = subprocess.run([*KUBE, "build"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(kube_bin)
    assert "reusing" in out.stderr
    for name in build.BINARIES:
        assert os.access(kube_bin / name, os.X_OK), name
    version = subprocess.run(
        [str(kube_bin / "kubectl"), "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
    )
    assert json.loads(version.stdout)["clientVersion"]["gitVersion"] == build.kubernetes_version()


def _up(directory: Path) -> subprocess.Popen:
    process = subprocess.Popen(
        [*KUBE, "up", str(directory)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = process.stdout.readline().strip()  # the kubeconfig's path, once ready
    assert line == str(directory / "kubeconfig"), line or process.stderr.read()
    return process


def _pids(directory: Path) -> dict[str, int]:
    return json.loads((directory / "state.json").read_text())["pids"]


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture
def lab_dir(kube_bin, tmp_path):
    from tests.support.kernel import skip_unless_kernel_ready

    skip_unless_kernel_ready()
    directory = tmp_path / "kube"
    yield directory
    subprocess.run([*KUBE, "down", str(directory)], capture_output=True, timeout=120)


def test_up_serves_the_api_until_down_stops_every_process(kube_bin, lab_dir):
    process = _up(lab_dir)
    pids = _pids(lab_dir)
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    kubectl = [str(kube_bin / "kubectl"), f"--kubeconfig={lab_dir / 'kubeconfig'}"]
    ready = subprocess.run([*kubectl, "get", "--raw", "/readyz"], capture_output=True, text=True)
    assert ready.stdout == "ok", ready.stderr
    # the EndpointSlice controller runs: the kubernetes Service has its slice
    slices = subprocess.run(
        [*kubectl, "get", "endpointslices", "-n", "default", "-o", "json"],
        capture_output=True,
        text=True,
    )
    assert "kubernetes" in slices.stdout
    down = subprocess.run([*KUBE, "down", str(lab_dir)], capture_output=True, text=True)
    assert down.returncode == 0, down.stderr
    assert process.wait(30) == 0
    assert not [name for name, pid in pids.items() if process_alive(pid)]
    assert f"kprkube-{process.pid}-" not in _netns()


def test_down_stops_what_an_up_killed_with_sigkill_left(kube_bin, lab_dir):
    process = _up(lab_dir)
    pids = _pids(lab_dir)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    time.sleep(0.5)
    assert all(process_alive(pid) for pid in pids.values())  # orphans, still serving
    down = subprocess.run([*KUBE, "down", str(lab_dir)], capture_output=True, text=True)
    assert down.returncode == 0, down.stderr
    assert "stopped kube-apiserver" in down.stderr
    assert not [name for name, pid in pids.items() if process_alive(pid)]
    assert f"kprkube-{process.pid}-" not in _netns()
