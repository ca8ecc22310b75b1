"""The lab's cluster DNS (lab.kube.dns): kubeadm's CoreDNS objects with the lab's values, and
the CoreDNS the lab builds answering for Services created through a real API server, as the
ServiceAccount those objects bind (no kubelet: CoreDNS runs as a process in a namespace of its
own)."""

from __future__ import annotations

import ipaddress
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from lab.kube import build, dns, objects
from lab.kube.controlplane import CLUSTER_DOMAIN, SERVICE_CIDRS
from lab.kube.forward import Forwarder, in_netns
from lab.kube.node import CLUSTER_DNS

# What kubeadm's manifests.go leaves to its template, with the values it gives them.
KUBEADM_VALUES = {
    "DNSIP": CLUSTER_DNS,
    "DNSDomain": CLUSTER_DOMAIN,
    "DeploymentName": "coredns",
    "Replicas": "2",
    "ControlPlaneTaintKey": "node-role.kubernetes.io/control-plane",
    "Image": "IMAGE",
}
KUBEADM_FORWARD = "    forward . /etc/resolv.conf {\n       max_concurrent 1000\n    }\n"


def kubernetes_source() -> Path:
    """The Kubernetes sources in the lab's module cache (the lab's build put them there)."""
    source = build.cache_root() / "go" / "mod" / f"k8s.io/kubernetes@{build.kubernetes_version()}"
    if not (source / "cmd" / "kubeadm").is_dir():
        pytest.skip(f"no Kubernetes sources at {source} (python -m lab.kube build)")
    return source


def kubeadm_manifests() -> dict[str, dict]:
    """kubeadm's CoreDNS objects by kind, rendered as kubeadm renders them for the lab."""
    text = (kubernetes_source() / "cmd/kubeadm/app/phases/addons/dns/manifests.go").read_text()
    objects = {}
    for template in re.findall(r"^\s*CoreDNS\w+ = `(.*?)`", text, re.M | re.S):
        # The only conditional: `cache 30{{- if .DNSDomain }} {...}{{- end }}`, DNSDomain set.
        rendered = re.sub(r"\s*\{\{- (?:if \.DNSDomain|end) \}\}", "", template)
        rendered = re.sub(r"\{\{ \.(\w+) \}\}", lambda m: KUBEADM_VALUES[m[1]], rendered)
        assert "{{" not in rendered, rendered
        manifest = yaml.safe_load(rendered)
        objects[manifest["kind"]] = manifest
    return objects


def by_kind(image: str = "IMAGE") -> dict[str, dict]:
    return {manifest["kind"]: manifest for manifest in dns.manifests(image)}


def test_the_service_is_at_the_kubelets_cluster_dns_with_kubeadms_names_and_ports():
    service = by_kind()["Service"]
    assert (service["metadata"]["namespace"], service["metadata"]["name"]) == (
        "kube-system",
        "kube-dns",
    )
    assert service["spec"]["clusterIP"] == CLUSTER_DNS == "10.96.0.10"
    assert ipaddress.ip_address(CLUSTER_DNS) in ipaddress.ip_network(SERVICE_CIDRS[0])
    assert [(p["name"], p["protocol"], p["port"]) for p in service["spec"]["ports"]] == [
        ("dns", "UDP", 53),
        ("dns-tcp", "TCP", 53),
        ("metrics", "TCP", 9153),
    ]
    deployment = by_kind("registry.k8s.io/coredns/coredns:v9")["Deployment"]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"] == pod["metadata"]["labels"] == {"k8s-app": "kube-dns"}
    assert pod["spec"]["containers"][0]["image"] == "registry.k8s.io/coredns/coredns:v9"
    assert f"kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa" in dns.COREFILE


def test_the_objects_are_kubeadms_but_for_the_forward():
    theirs = kubeadm_manifests()
    ours = by_kind()
    assert (
        set(ours)
        == set(theirs)
        == {
            "ClusterRole",
            "ClusterRoleBinding",
            "ServiceAccount",
            "ConfigMap",
            "Deployment",
            "Service",
        }
    )
    corefile = theirs["ConfigMap"]["data"].pop("Corefile")
    assert KUBEADM_FORWARD in corefile
    assert ours["ConfigMap"]["data"].pop("Corefile") == corefile.replace(KUBEADM_FORWARD, "")
    for kind, manifest in theirs.items():
        assert ours[kind] == manifest, kind


def test_the_image_is_kubeadms_and_the_build_pins_its_version():
    constants = (kubernetes_source() / "cmd/kubeadm/app/constants/constants.go").read_text()
    kubeadm_version = re.search(r'CoreDNSVersion = "(v[^"]+)"', constants)[1]
    assert dns.version() == kubeadm_version
    assert dns.image_reference() == f"registry.k8s.io/coredns/coredns:{kubeadm_version}"


def test_the_image_is_the_binary_alone_as_its_entrypoint():
    containerfile = dns.CONTAINERFILE.read_text()
    instructions = [line for line in containerfile.splitlines() if not line.startswith("#")]
    assert instructions == [
        "FROM scratch",
        "COPY coredns /coredns",
        "EXPOSE 53 53/udp",
        'ENTRYPOINT ["/coredns"]',
    ]


# -- the real thing: the built CoreDNS against a real API server ------------------------------


def test_the_built_coredns_is_the_pinned_version(kube_bin):
    out = subprocess.run([str(kube_bin / "coredns"), "-version"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"CoreDNS-{dns.version().removeprefix('v')}\n"), out.stdout


@pytest.fixture(scope="module")
def kubectl(kube_bin, control_plane):
    def run(*args: str, timeout: float = 60, check: bool = True) -> str:
        return objects.kubectl(
            kube_bin, control_plane.kubeconfig, *args, check=check, timeout=timeout
        )

    return run


@pytest.fixture(scope="module")
def coredns(kube_bin, control_plane, kubectl, tmp_path_factory):
    """The lab's objects applied; CoreDNS with their Corefile in a network namespace of its own,
    reaching the API server (through a forwarder) as their ServiceAccount. Yields the
    namespace's path."""
    from lab.netns import _delete_netns, _ip_batch, _run

    directory = tmp_path_factory.mktemp("coredns")
    dns.apply(kubectl, dns.image_reference())
    corefile = kubectl("-n", "kube-system", "get", "configmap", "coredns", "-o",
                       "jsonpath={.data.Corefile}")  # fmt: skip
    token = kubectl("-n", "kube-system", "create", "token", "coredns").strip()
    kubeconfig = control_plane.write_kubeconfig(directory / "coredns.kubeconfig", token)
    # In a pod the kubernetes plugin finds the API server from its ServiceAccount; here it is
    # told, and that is the one change to the Corefile.
    kubernetes_block = f"kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
    assert kubernetes_block in corefile
    corefile = corefile.replace(
        kubernetes_block, f"{kubernetes_block}       kubeconfig {kubeconfig}\n"
    )
    (directory / "Corefile").write_text(corefile)
    netns = f"kprdns-{control_plane.lab_id}"
    netns_path = f"/run/netns/{netns}"
    _run(["ip", "netns", "add", netns])
    forwarder = process = None
    try:
        _ip_batch(netns, ["link set lo up"])
        forwarder = Forwarder(netns_path, control_plane.ports["apiserver"])
        with open(directory / "coredns.log", "wb") as log:
            process = subprocess.Popen(
                [
                    "nsenter",
                    f"--net={netns_path}",
                    "--",
                    str(kube_bin / "coredns"),
                    "-conf",
                    str(directory / "Corefile"),
                ],  # fmt: skip
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _wait_ready(netns_path, process, directory / "coredns.log")
        yield netns_path, process, directory / "coredns.log"
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if forwarder is not None:
            forwarder.close()
        _delete_netns(netns)


def _wait_ready(netns_path: str, process: subprocess.Popen, log: Path) -> None:
    """Until CoreDNS's ready plugin says every plugin (kubernetes: synced with the API) is."""

    def ready() -> bool:
        try:
            with urllib.request.urlopen("http://127.0.0.1:8181/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, f"coredns exited: {log.read_text()}"
        if in_netns(netns_path, ready):
            return
        time.sleep(0.2)
    raise AssertionError(f"coredns not ready within 60 s: {log.read_text()}")


def _query(netns_path: str, name: str) -> tuple[str, list[str]]:
    return in_netns(netns_path, lambda: dns.query_a("127.0.0.1", name))


def _until(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def test_coredns_answers_for_services_created_through_the_api(coredns, kubectl):
    netns_path, process, log = coredns
    kubectl("create", "namespace", "dns-test")
    kubectl("-n", "dns-test", "create", "service", "clusterip", "endpoint-test2", "--tcp=80:80")
    cluster_ip = kubectl("-n", "dns-test", "get", "service", "endpoint-test2", "-o",
                         "jsonpath={.spec.clusterIP}")  # fmt: skip
    name = f"endpoint-test2.dns-test.svc.{CLUSTER_DOMAIN}"

    assert _until(lambda: _query(netns_path, name) == ("NOERROR", [cluster_ip])), (
        _query(netns_path, name),
        log.read_text(),
    )
    assert _query(netns_path, f"kube-dns.kube-system.svc.{CLUSTER_DOMAIN}") == (
        "NOERROR",
        [CLUSTER_DNS],
    )
    assert _query(netns_path, f"kubernetes.default.svc.{CLUSTER_DOMAIN}") == (
        "NOERROR",
        ["10.96.0.1"],
    )
    assert _query(netns_path, f"no-such-service.dns-test.svc.{CLUSTER_DOMAIN}") == (
        "NXDOMAIN",
        [],
    )
    # Nothing to forward to: a name outside the cluster fails at once rather than timing out.
    assert _query(netns_path, "example.org") == ("SERVFAIL", [])

    kubectl("-n", "dns-test", "delete", "service", "endpoint-test2")
    # The Corefile caches no cluster.local answer: the name goes with the Service.
    assert _until(lambda: _query(netns_path, name) == ("NXDOMAIN", []), timeout=10), _query(
        netns_path, name
    )
    assert process.poll() is None, log.read_text()  # the loop plugin found no loop


def test_the_objects_apply_again_over_themselves(coredns, kubectl):
    # install() on a cluster that has them (kubeadm's resourceVersion "0" included).
    dns.apply(kubectl, dns.image_reference())
    ip = kubectl(
        "-n", "kube-system", "get", "service", "kube-dns", "-o", "jsonpath={.spec.clusterIP}"
    )
    assert ip == CLUSTER_DNS
