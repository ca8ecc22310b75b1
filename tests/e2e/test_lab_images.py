"""lab.kube.images: the lab's container images, built with no registry, imported into a
containerd of the test's own (own root, state and socket; not the machine's) and run there as
the kubelet's runtime would run them."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lab.kube import build, dns, images

IDS = itertools.count()


def _skip_unless_able_to_build() -> None:
    if os.geteuid() != 0:
        pytest.skip("building and running images needs root")
    missing = [tool for tool in ("buildah", "containerd", "ctr", "runc") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian packages buildah, containerd, runc)")
    try:
        build.find_go()
    except build.GoMissing as err:
        pytest.skip(f"{err}: the image names come from the Kubernetes sources")


@dataclass
class Built:
    references: dict[str, str]  # short name -> reference
    archives: dict[str, Path]  # reference -> archive
    seconds: float

    def reference(self, name: str) -> str:
        if self.references[name] not in self.archives:
            pytest.skip(f"{name} not built: the lab's binaries are not (python -m lab.kube build)")
        return self.references[name]


@pytest.fixture(scope="session")
def built() -> Built:
    """Every image, built once per session (minutes cold, a second from the cache)."""
    _skip_unless_able_to_build()
    names = [
        n for n in images.NAMES if n not in ("agnhost", "coredns", "kube-proxy") or build.cached()
    ]
    started = time.monotonic()
    archives = images.build_images(names)
    seconds = time.monotonic() - started
    print(f"\nbuild_images({len(names)} images): {seconds:.1f} s", file=sys.stderr)
    references = {
        "kpr": images.KPR_IMAGE,
        "coredns": dns.image_reference(),
        "kube-proxy": images.kube_proxy_image(),
        **images.e2e_references(build.kubernetes_source()),
    }
    return Built(references, archives, seconds)


@dataclass
class Containerd:
    directory: Path
    address: str

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ctr", "--address", self.address, "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def run(
        self, image: str, *argv: str, options: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess:
        """`ctr run --rm` in the container's own network namespace (only a loopback)."""
        name = f"kpr-test-{os.getpid()}-{next(IDS)}"
        return self._run("--rm", *options, image, name, *argv)

    def start(self, image: str) -> str:
        """`ctr run -d` of the image's own command; the container's name."""
        name = f"kpr-test-{os.getpid()}-{next(IDS)}"
        done = self._run("-d", image, name)
        assert done.returncode == 0, done.stderr
        return name

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        # runc's state and the I/O fifos in the test's directory, not under /run/containerd
        state = [
            "--runc-root",
            str(self.directory / "runc"),
            "--fifo-dir",
            str(self.directory / "fifo"),
        ]
        return self.ctr("run", *state, *args)

    def stop_all(self) -> None:
        for task in self.ctr("tasks", "ls", "-q").stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task)
            for _ in range(50):
                if self.ctr("tasks", "delete", task).returncode == 0:
                    break
                time.sleep(0.1)
        for container in self.ctr("containers", "ls", "-q").stdout.split():
            self.ctr("containers", "rm", container)


@pytest.fixture(scope="module")
def containerd(built, tmp_path_factory):
    """A containerd of the test's own with every built image imported into k8s.io."""
    directory = tmp_path_factory.mktemp("containerd")
    address = str(directory / "containerd.sock")
    config = directory / "config.toml"
    config.write_text(
        "version = 2\n"
        f'root = "{directory / "root"}"\n'
        f'state = "{directory / "state"}"\n'
        # no kubelet here: ctr needs no CRI (and the CRI plugin would look for CNI)
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{address}"\n'
        f'[ttrpc]\n  address = "{address}.ttrpc"\n'
        '[debug]\n  address = ""\n'
    )
    with open(directory / "containerd.log", "w") as log:
        process = subprocess.Popen(
            ["containerd", "--config", str(config)], stdout=log, stderr=subprocess.STDOUT
        )
    runtime = Containerd(directory, address)
    try:
        deadline = time.monotonic() + 30
        while runtime.ctr("version", timeout=10).returncode != 0:
            assert process.poll() is None, (directory / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not answer in 30 s"
            time.sleep(0.2)
        started = time.monotonic()
        images.import_images(address, list(built.archives.values()))
        print(f"\nimport_images({len(built.archives)}): {time.monotonic() - started:.1f} s")
        yield runtime
    finally:
        runtime.stop_all()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def test_names_and_tags_are_the_ones_kubernetes_uses():
    _skip_unless_able_to_build()
    source = build.kubernetes_source()
    references = images.e2e_references(source)
    # kubeadm's pause is the sandbox image a node's runtime is configured with
    kubeadm = (source / "cmd/kubeadm/app/constants/constants.go").read_text()
    (pause,) = re.findall(r'PauseVersion = "([^"]+)"', kubeadm)
    assert references["pause"] == f"registry.k8s.io/pause:{pause}"
    agnhost = (source / "test/images/agnhost/VERSION").read_text().strip()
    assert references["agnhost"] == f"registry.k8s.io/e2e-test-images/agnhost:{agnhost}"
    assert references["busybox"].startswith("registry.k8s.io/e2e-test-images/busybox:")


def test_ctr_import_names_each_image_as_the_manifests_do(containerd, built):
    listed = set(containerd.ctr("images", "ls", "-q").stdout.split())
    assert set(built.archives) <= listed, sorted(set(built.archives) - listed)


def test_pause_runs_until_it_is_stopped(containerd, built):
    name = containerd.start(built.reference("pause"))
    time.sleep(1)
    assert task_status(containerd, name) == "RUNNING"
    containerd.ctr("tasks", "kill", "-s", "SIGTERM", name)
    for _ in range(50):
        if task_status(containerd, name) == "STOPPED":
            break
        time.sleep(0.1)
    assert task_status(containerd, name) == "STOPPED"
    assert containerd.ctr("tasks", "delete", name).returncode == 0
    containerd.ctr("containers", "rm", name)


def test_agnhost_serves_netexec_and_has_the_tools_e2e_tests_run(containerd, built):
    script = (
        "/agnhost netexec --http-port 8080 & "
        "for i in $(seq 50); do curl -sf http://127.0.0.1:8080/hostname && break; sleep 0.1; done; "
        "echo; for tool in nc dig ss iperf bash; do command -v $tool; done"
    )
    done = containerd.run(built.reference("agnhost"), "sh", "-c", script)
    assert done.returncode == 0, done.stderr
    hostname, *tools = done.stdout.splitlines()
    assert hostname  # netexec answered with the container's hostname
    assert [Path(tool).name for tool in tools] == ["nc", "dig", "ss", "iperf", "bash"]


def test_busybox_runs_a_shell_with_nc_and_wget(containerd, built):
    # the shapes e2e tests use: `sh -c`, `/bin/sh -c`, nc and wget on PATH
    script = "echo ok; for t in nc wget sleep; do test -x /bin/$t && echo $t; done"
    done = containerd.run(built.reference("busybox"), "/bin/sh", "-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ok", "nc", "wget", "sleep"]
    done = containerd.run(built.reference("busybox"), "sh", "-c", "nc 2>&1 | head -1")
    assert "BusyBox" in done.stdout, done.stdout


@pytest.mark.parametrize("name", ["nginx", "httpd"])
def test_web_server_images_serve_on_port_80(containerd, built, name):
    server = containerd.start(built.reference(name))
    # bash's /dev/tcp: the base image has no HTTP client
    fetch = (
        "for i in $(seq 50); do (: <>/dev/tcp/127.0.0.1/80) 2>/dev/null && break; sleep 0.1; done; "
        'exec 3<>/dev/tcp/127.0.0.1/80; printf "GET / HTTP/1.0\\r\\n\\r\\n" >&3; head -1 <&3'
    )
    done = containerd.ctr("tasks", "exec", "--exec-id", "get", server, "bash", "-c", fetch)
    assert done.stdout.startswith("HTTP/1.1 200"), (done.stdout, done.stderr)


def test_jessie_dnsutils_has_dig(containerd, built):
    done = containerd.run(built.reference("jessie-dnsutils"), "dig", "-v")
    assert done.returncode == 0 and "DiG 9." in done.stdout + done.stderr, done.stderr


def test_coredns_image_runs_coredns_as_its_entrypoint(containerd, built):
    reference = built.reference("coredns")
    done = containerd.run(reference, "/coredns", "-version")
    assert done.returncode == 0 and done.stdout.startswith("CoreDNS-"), done.stderr
    name = containerd.start(reference)  # the entrypoint, no Corefile: CoreDNS's default server
    time.sleep(1)
    assert task_status(containerd, name) == "RUNNING"


def test_kpr_image_runs_the_kpr_cli(containerd, built):
    done = containerd.run(images.KPR_IMAGE, "kpr", "--help")
    assert done.returncode == 0, done.stderr
    assert "Usage: kpr" in done.stdout


# In the image, with none of the node's /lib/modules or /usr/src mounted: kpr finds the headers
# it ships, and BCC compiles and loads both programs against them (maps pinned in a bpffs of
# the container's own, gone with it; nothing is attached).
COMPILE_IN_IMAGE = """
import lzma  # kheaders.tar.xz, on nodes that have it
from pathlib import Path
from kpr.node import host
from kpr.datapath import abi, loader
headers = host.require_kernel_headers()
print(headers.origin, headers.path)
pins = Path("/sys/fs/bpf/kpr-image-test")
host.ensure_bpffs(pins)
for source in ("sock_lb.c", "nodeport.c"):
    bpf = loader.compile_and_pin(pins, abi.MapSizes(), source)
    print(source, len(bpf.tables))
"""


def test_kpr_image_compiles_its_programs_against_the_headers_it_ships(containerd, built):
    from kpr.node import host

    done = containerd.run(
        images.KPR_IMAGE, "python3", "-c", COMPILE_IN_IMAGE, options=("--privileged",)
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"shipped {host.SHIPPED_HEADERS}"
    assert [line.split()[0] for line in lines[1:]] == ["sock_lb.c", "nodeport.c"]


def test_kube_proxy_image_is_kubeadms_with_the_tools_upstreams_has(containerd, built):
    """kubeadm's DaemonSet runs /usr/local/bin/kube-proxy; iptables (nft backend), nft and
    conntrack are what kube-proxy and docs/operations.md's migration run in its pod."""
    reference = built.reference("kube-proxy")
    assert reference == f"registry.k8s.io/kube-proxy:{build.kubernetes_version()}"
    done = containerd.run(
        reference,
        "sh",
        "-c",
        "/usr/local/bin/kube-proxy --version && iptables --version && nft --version"
        " && conntrack --version",
    )
    assert done.returncode == 0, done.stderr
    version, iptables, *_ = done.stdout.splitlines()
    assert version == f"Kubernetes {build.kubernetes_version()}"
    assert "(nf_tables)" in iptables


def test_unchanged_images_are_reused_and_a_changed_one_rebuilt(built, tmp_path, monkeypatch):
    started = time.monotonic()
    assert images.build_images(built_names(built)) == built.archives
    assert time.monotonic() - started < 30  # only hashing: nothing rebuilt
    # A changed Containerfile in a cache of its own (the session's archives stay as they are).
    containerfiles = tmp_path / "containerfiles"
    shutil.copytree(images.CONTAINERFILES, containerfiles)
    monkeypatch.setattr(images, "CONTAINERFILES", containerfiles)
    monkeypatch.setattr(images, "images_root", lambda: tmp_path / "images")
    monkeypatch.setattr(images, "archives_dir", lambda: tmp_path / "images" / "archives")
    (first,) = images.build_images(["busybox"]).values()
    containerfile = containerfiles / "busybox" / "Containerfile"
    containerfile.write_text(containerfile.read_text() + "ENV KPR_TEST=1\n")
    (second,) = images.build_images(["busybox"]).values()
    assert second != first and second.exists()
    assert first.exists()  # another clone may still build the first: kept (the last three are)
    assert images.build_images(["busybox"]) == {built.references["busybox"]: second}
    assert mounts_under(tmp_path) == []


def test_builds_leave_no_mount_behind(built):
    assert mounts_under(images.images_root()) == []


def mounts_under(directory: Path) -> list[str]:
    lines = Path("/proc/self/mountinfo").read_text().splitlines()
    return [line for line in lines if str(directory) in line]


def task_status(containerd: Containerd, name: str) -> str:
    for line in containerd.ctr("tasks", "ls").stdout.splitlines()[1:]:
        task, _pid, status = line.split()
        if task == name:
            return status
    return "absent"


def built_names(built: Built) -> list[str]:
    return [name for name, reference in built.references.items() if reference in built.archives]
